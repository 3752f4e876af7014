;; chatty: a policy that logs through kvhost.log: one message at init, and
;; per kvhost_evict one of 5000 bytes (the host truncates it to 1024) then
;; 150 short ones (the host lets 100 a second through). It admits every
;; other key and supports no naming (kvhost_name returns "unsupported").
(module
  (import "kvhost" "log" (func $log (param i32 i32 i32)))
  (memory (export "memory") 8)
  (data (i32.const 0x100) "chatty: init")
  (data (i32.const 0x200) "chatty: evicting")
  (func (export "kvhost_abi_version") (result i32) (i32.const 1))
  (func (export "kvhost_features") (result i64) (i64.const 2)) ;; FeatureAdmit
  (func (export "kvhost_scratch") (param i32) (result i32) (i32.const 0x10000))
  (func (export "kvhost_init") (param i32) (result i32)
    (call $log (i32.const 0) (i32.const 0x100) (i32.const 12))
    (i32.const 0))
  (func (export "kvhost_name") (param i32) (result i32) (i32.const -3))
  (func (export "kvhost_access") (param i32) (result i32) (i32.const 0))
  ;; AdmitRecord (40 bytes): Admit @32 = index & 1.
  (func (export "kvhost_admit") (param $n i32) (result i32)
    (local $i i32)
    (block $done (loop $l
      (br_if $done (i32.ge_u (local.get $i) (local.get $n)))
      (i32.store offset=0x10020 (i32.mul (local.get $i) (i32.const 40)) (i32.and (local.get $i) (i32.const 1)))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br $l)))
    (i32.const 0))
  (func (export "kvhost_evict") (param i32) (result i32)
    (local $i i32)
    (call $log (i32.const 8) (i32.const 0) (i32.const 5000))
    (loop $l
      (call $log (i32.const 4) (i32.const 0x200) (i32.const 16))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br_if $l (i32.lt_u (local.get $i) (i32.const 150))))
    (i32.const 0))
)
