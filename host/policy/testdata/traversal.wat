;; traversal: hostile fixture. kvhost_name answers "../../etc/passwd" for
;; every key; the host must reject the path.
(module
  (memory (export "memory") 8)
  (func (export "kvhost_features") (result i64) (i64.const 0))
  (func (export "kvhost_scratch") (param i32) (result i32) (i32.const 0x10000))
  (func (export "kvhost_init") (param i32) (result i32) (i32.const 0))
  (func (export "kvhost_access") (param i32) (result i32) (i32.const 0))
  (func (export "kvhost_abi_version") (result i32) (i32.const 1))
  (func (export "kvhost_evict") (param i32) (result i32) (i32.const 0))
  (data (i32.const 0x100) "../../etc/passwd")
  (func (export "kvhost_name") (param $n i32) (result i32)
    (local $r i32)
    (local.set $r (i32.const 0x10000))
    (block $done (loop $rec
      (br_if $done (i32.ge_u (local.get $r) (i32.add (i32.const 0x10000) (i32.mul (local.get $n) (i32.const 368)))))
      (i32.store offset=96 (local.get $r) (i32.const 0))
      (i32.store offset=100 (local.get $r) (i32.const 16))
      (memory.copy (i32.add (local.get $r) (i32.const 112)) (i32.const 0x100) (i32.const 16))
      (local.set $r (i32.add (local.get $r) (i32.const 368)))
      (br $rec)))
    (i32.const 0))
)
