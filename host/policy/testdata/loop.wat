;; loop: hostile fixture. kvhost_name never returns; the host must cut the
;; call at its deadline, replace the instance and finally fall back.
(module
  (memory (export "memory") 8)
  (func (export "kvhost_features") (result i64) (i64.const 0))
  (func (export "kvhost_scratch") (param i32) (result i32) (i32.const 0x10000))
  (func (export "kvhost_init") (param i32) (result i32) (i32.const 0))
  (func (export "kvhost_access") (param i32) (result i32) (i32.const 0))
  (func (export "kvhost_abi_version") (result i32) (i32.const 1))
  (func (export "kvhost_evict") (param i32) (result i32) (i32.const 0))
  (func (export "kvhost_name") (param i32) (result i32)
    (loop $forever (br $forever))
    (i32.const 0))
)
