;; noevict: hostile fixture. Everything but kvhost_evict; the host must
;; refuse to load it and name the missing export.
(module
  (memory (export "memory") 8)
  (func (export "kvhost_features") (result i64) (i64.const 0))
  (func (export "kvhost_scratch") (param i32) (result i32) (i32.const 0x10000))
  (func (export "kvhost_init") (param i32) (result i32) (i32.const 0))
  (func (export "kvhost_access") (param i32) (result i32) (i32.const 0))
  (func (export "kvhost_abi_version") (result i32) (i32.const 1))
  ;; kvhost_name: path = KeyHash as 16 letters a-p, mount 0.
  (func (export "kvhost_name") (param $n i32) (result i32)
    (local $r i32) (local $k i32) (local $h i64)
    (local.set $r (i32.const 0x10000))
    (block $done (loop $rec
      (br_if $done (i32.ge_u (local.get $r) (i32.add (i32.const 0x10000) (i32.mul (local.get $n) (i32.const 368)))))
      (local.set $h (i64.load offset=8 (local.get $r)))
      (local.set $k (i32.const 0))
      (loop $c
        (i32.store8 offset=112 (i32.add (local.get $r) (local.get $k))
          (i32.add (i32.const 97) (i32.wrap_i64 (i64.and (i64.shr_u (local.get $h) (i64.extend_i32_u (i32.shl (local.get $k) (i32.const 2)))) (i64.const 15)))))
        (local.set $k (i32.add (local.get $k) (i32.const 1)))
        (br_if $c (i32.lt_u (local.get $k) (i32.const 16))))
      (i32.store offset=96 (local.get $r) (i32.const 0))
      (i32.store offset=100 (local.get $r) (i32.const 16))
      (local.set $r (i32.add (local.get $r) (i32.const 368)))
      (br $rec)))
    (i32.const 0))
)
