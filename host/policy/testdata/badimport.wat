;; badimport: hostile fixture. A complete policy that imports env.abort,
;; which the host does not provide; the host must refuse to load it.
(module
  (import "env" "abort" (func $abort (param i32)))
  (memory (export "memory") 8)
  (func (export "kvhost_abi_version") (result i32) (i32.const 1))
  (func (export "kvhost_features") (result i64) (i64.const 0))
  (func (export "kvhost_scratch") (param i32) (result i32) (i32.const 0x10000))
  (func (export "kvhost_init") (param i32) (result i32) (i32.const 0))
  (func (export "kvhost_name") (param i32) (result i32) (call $abort (i32.const 0)) (i32.const 0))
  (func (export "kvhost_access") (param i32) (result i32) (i32.const 0))
  (func (export "kvhost_evict") (param i32) (result i32) (i32.const 0))
)
