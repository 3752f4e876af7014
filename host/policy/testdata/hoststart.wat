;; hoststart: hostile fixture. Its start function, which runs when the
;; module is instantiated, before the host sets any call's fuel, makes 40
;; calls of fd_write with 2^20 iovecs each (zeros from 0x80000). The host's
;; work must come out of the meter's initial fuel (2^30 units), so that the
;; start function runs out of it instead of loading after 40 host calls of
;; about 30 ms each.
(module
  (import "wasi_snapshot_preview1" "fd_write" (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 160)
  (func $start
    (local $i i32)
    (loop $l
      (drop (call $fd_write (i32.const 1) (i32.const 0x80000) (i32.const 0x100000) (i32.const 0x40)))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br_if $l (i32.lt_u (local.get $i) (i32.const 40)))))
  (start $start)
  (func (export "kvhost_abi_version") (result i32) (i32.const 1))
  (func (export "kvhost_features") (result i64) (i64.const 0))
  (func (export "kvhost_scratch") (param i32) (result i32) (i32.const 0x10000))
  (func (export "kvhost_init") (param i32) (result i32) (i32.const 0))
  (func (export "kvhost_access") (param i32) (result i32) (i32.const 0))
  (func (export "kvhost_evict") (param i32) (result i32) (i32.const 0))
  (func (export "kvhost_name") (param i32) (result i32) (i32.const 0))
)
