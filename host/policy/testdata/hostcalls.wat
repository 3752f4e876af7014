;; hostcalls: hostile fixture. kvhost_name calls one imported host function
;; a few times, each call with arguments that make the host do much work:
;; millions of iovecs or poll subscriptions, megabytes of random bytes or of
;; path, or a hundred thousand cheap calls. The wasm instructions it runs
;; cost little fuel; the host's work must cost fuel too, so that the call
;; runs out of it instead of returning (STATUS_INTERNAL) long after its
;; deadline.
;;
;; The host function is chosen by the configuration's first parameter,
;; "f=X\n" (the value X at scratch offset 2, kept by kvhost_init): w
;; fd_write to stdout, e fd_write to stderr, r fd_read from stdin, p
;; poll_oneoff, g random_get, o path_open, c clock_time_get, l kvhost.log.
;;
;; Memory (64 pages, 4 MiB): scratch at 0x10000; zeros from 0x80000 (zero
;; iovecs, clock subscriptions of no timeout, a path of NUL bytes); poll
;; events out at 0x300000; results at 0x40.
(module
  (import "wasi_snapshot_preview1" "fd_write" (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "fd_read" (func $fd_read (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "poll_oneoff" (func $poll_oneoff (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "random_get" (func $random_get (param i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "path_open" (func $path_open (param i32 i32 i32 i32 i32 i64 i64 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "clock_time_get" (func $clock_time_get (param i32 i64 i32) (result i32)))
  (import "kvhost" "log" (func $log (param i32 i32 i32)))
  (memory (export "memory") 64)
  (global $which (mut i32) (i32.const 0))

  (func (export "kvhost_abi_version") (result i32) (i32.const 1))
  (func (export "kvhost_features") (result i64) (i64.const 0))
  (func (export "kvhost_scratch") (param i32) (result i32) (i32.const 0x10000))
  (func (export "kvhost_init") (param i32) (result i32)
    (global.set $which (i32.load8_u (i32.const 0x10002)))
    (i32.const 0))
  (func (export "kvhost_access") (param i32) (result i32) (i32.const 0))
  (func (export "kvhost_evict") (param i32) (result i32) (i32.const 0))

  ;; call makes one round of host calls of the chosen kind.
  (func $call (param $w i32)
    (local $i i32)
    (if (i32.eq (local.get $w) (i32.const 119)) ;; w: 256Ki iovecs to stdout
      (then (drop (call $fd_write (i32.const 1) (i32.const 0x80000) (i32.const 0x40000) (i32.const 0x40)))))
    (if (i32.eq (local.get $w) (i32.const 101)) ;; e: 256Ki iovecs to stderr
      (then (drop (call $fd_write (i32.const 2) (i32.const 0x80000) (i32.const 0x40000) (i32.const 0x40)))))
    (if (i32.eq (local.get $w) (i32.const 114)) ;; r: 256Ki iovecs from stdin
      (then (drop (call $fd_read (i32.const 0) (i32.const 0x80000) (i32.const 0x40000) (i32.const 0x40)))))
    (if (i32.eq (local.get $w) (i32.const 112)) ;; p: 32Ki subscriptions
      (then (drop (call $poll_oneoff (i32.const 0x80000) (i32.const 0x300000) (i32.const 0x8000) (i32.const 0x40)))))
    (if (i32.eq (local.get $w) (i32.const 103)) ;; g: 2 MiB of random bytes
      (then (drop (call $random_get (i32.const 0x80000) (i32.const 0x200000)))))
    (if (i32.eq (local.get $w) (i32.const 111)) ;; o: a path of 256 KiB
      (then (drop (call $path_open (i32.const 3) (i32.const 0) (i32.const 0x80000) (i32.const 0x40000)
        (i32.const 0) (i64.const 0) (i64.const 0) (i32.const 0) (i32.const 0x40)))))
    (if (i32.eq (local.get $w) (i32.const 99)) ;; c: 12,500 clock readings
      (then (loop $l
        (drop (call $clock_time_get (i32.const 0) (i64.const 0) (i32.const 0x40)))
        (local.set $i (i32.add (local.get $i) (i32.const 1)))
        (br_if $l (i32.lt_u (local.get $i) (i32.const 12500))))))
    (if (i32.eq (local.get $w) (i32.const 108)) ;; l: 12,500 log messages
      (then (loop $l
        (call $log (i32.const -4) (i32.const 0x80000) (i32.const 1))
        (local.set $i (i32.add (local.get $i) (i32.const 1)))
        (br_if $l (i32.lt_u (local.get $i) (i32.const 12500)))))))

  ;; kvhost_name makes 8 rounds of calls, then fails.
  (func (export "kvhost_name") (param i32) (result i32)
    (local $round i32)
    (loop $l
      (call $call (global.get $which))
      (local.set $round (i32.add (local.get $round) (i32.const 1)))
      (br_if $l (i32.lt_u (local.get $round) (i32.const 8))))
    (i32.const -4))
)
