;; logloop: hostile fixture. kvhost_name logs a warning ("logloop:
;; looping") and then never returns, as loop does: the host must stop it by
;; its fuel. Tests use the warning to act while the call runs.
(module
  (import "kvhost" "log" (func $log (param i32 i32 i32)))
  (memory (export "memory") 8)
  (data (i32.const 0x100) "logloop: looping")
  (func (export "kvhost_abi_version") (result i32) (i32.const 1))
  (func (export "kvhost_features") (result i64) (i64.const 0))
  (func (export "kvhost_scratch") (param i32) (result i32) (i32.const 0x10000))
  (func (export "kvhost_init") (param i32) (result i32) (i32.const 0))
  (func (export "kvhost_access") (param i32) (result i32) (i32.const 0))
  (func (export "kvhost_evict") (param i32) (result i32) (i32.const 0))
  (func (export "kvhost_name") (param i32) (result i32)
    (call $log (i32.const 4) (i32.const 0x100) (i32.const 16))
    (loop $forever (br $forever))
    (i32.const 0))
)
