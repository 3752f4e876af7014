;; clock: reads WASI's wall clock and reports what it read through its
;; statuses (it has no other output the host shows): kvhost_name returns
;; -(s + 1), s the whole seconds of its first reading since 2022-01-01
;; UTC; kvhost_evict returns the microseconds between two readings in a
;; row, far more victims than the host asks for. Results at 0x40, 0x48.
(module
  (import "wasi_snapshot_preview1" "clock_time_get" (func $clock_time_get (param i32 i64 i32) (result i32)))
  (memory (export "memory") 8)
  (func $now (param $at i32) (result i64)
    (drop (call $clock_time_get (i32.const 0) (i64.const 0) (local.get $at)))
    (i64.load (local.get $at)))
  (func (export "kvhost_abi_version") (result i32) (i32.const 1))
  (func (export "kvhost_features") (result i64) (i64.const 0))
  (func (export "kvhost_scratch") (param i32) (result i32) (i32.const 0x10000))
  (func (export "kvhost_init") (param i32) (result i32) (i32.const 0))
  (func (export "kvhost_access") (param i32) (result i32) (i32.const 0))
  (func (export "kvhost_name") (param i32) (result i32)
    ;; 1640995200: 2022-01-01T00:00:00Z in Unix seconds.
    (i32.sub (i32.const -1)
      (i32.wrap_i64 (i64.sub (i64.div_u (call $now (i32.const 0x40)) (i64.const 1000000000)) (i64.const 1640995200)))))
  (func (export "kvhost_evict") (param i32) (result i32)
    (local $first i64)
    (local.set $first (call $now (i32.const 0x40)))
    (i32.wrap_i64 (i64.div_u (i64.sub (call $now (i32.const 0x48)) (local.get $first)) (i64.const 1000))))
)
