;; trapnth: hostile fixture. It traps (unreachable) on the 40th call of
;; kvhost_name, kvhost_access or kvhost_evict of each instance, so that the
;; host recovers (it rebuilds the instance from its index and retries the
;; call) and every later answer looks right: the conformance suite must
;; fail the check during which the trap happened, naming the trap, not
;; only its catch-all "no host rejections".
;; Otherwise it is the wellbehaved fixture, so that only the defect fails.
(module
  (memory (export "memory") 40)

  ;; calls counts the calls of the hooks with records; the 40th traps.
  (global $calls (mut i32) (i32.const 0))
  (func $count
    (global.set $calls (i32.add (global.get $calls) (i32.const 1)))
    (if (i32.eq (global.get $calls) (i32.const 40)) (then (unreachable))))

  (func (export "kvhost_abi_version") (result i32) (i32.const 1))
  (func (export "kvhost_features") (result i64) (i64.const 0))
  (func (export "kvhost_scratch") (param $n i32) (result i32)
    (if (result i32) (i32.gt_u (local.get $n) (i32.const 0x60000))
      (then (i32.const 0)) (else (i32.const 0x10000))))
  (func (export "kvhost_init") (param $n i32) (result i32) (i32.const 0))

  ;; letters writes v as 16 letters 'a'+nibble, low nibble first.
  (func $letters (param $dst i32) (param $v i64)
    (local $k i32)
    (loop $l
      (i32.store8 (i32.add (local.get $dst) (local.get $k))
        (i32.add (i32.const 97) (i32.wrap_i64 (i64.and (local.get $v) (i64.const 15)))))
      (local.set $v (i64.shr_u (local.get $v) (i64.const 4)))
      (local.set $k (i32.add (local.get $k) (i32.const 1)))
      (br_if $l (i32.lt_u (local.get $k) (i32.const 16)))))

  ;; NameRecord (368 bytes): KeyHash @8, Fingerprint @16, MountCount @28,
  ;; Mount @96, PathLen @100, Path @112.
  (func (export "kvhost_name") (param $n i32) (result i32)
    (local $r i32) (local $end i32) (local $mounts i32)
    (call $count)
    (local.set $r (i32.const 0x10000))
    (local.set $end (i32.add (i32.const 0x10000) (i32.mul (local.get $n) (i32.const 368))))
    (block $done
      (loop $l
        (br_if $done (i32.ge_u (local.get $r) (local.get $end)))
        (local.set $mounts (i32.load offset=28 (local.get $r)))
        (if (i32.eqz (local.get $mounts)) (then (return (i32.const -1))))
        (i32.store offset=96 (local.get $r)
          (i32.wrap_i64 (i64.rem_u (i64.load offset=8 (local.get $r)) (i64.extend_i32_u (local.get $mounts)))))
        (call $letters (i32.add (local.get $r) (i32.const 112)) (i64.load offset=16 (local.get $r)))
        (i32.store8 offset=128 (local.get $r) (i32.const 47)) ;; '/'
        (call $letters (i32.add (local.get $r) (i32.const 129)) (i64.load offset=8 (local.get $r)))
        (i32.store offset=100 (local.get $r) (i32.const 33))
        (local.set $r (i32.add (local.get $r) (i32.const 368)))
        (br $l)))
    (i32.const 0))

  (func $home (param $e i64) (result i32)
    (i32.wrap_i64 (i64.shr_u (i64.mul (local.get $e) (i64.const 0x9E3779B97F4A7C15)) (i64.const 48))))
  (func $slot (param $i i32) (result i32)
    (i32.add (i32.const 0x70000) (i32.shl (i32.and (local.get $i) (i32.const 0xffff)) (i32.const 5))))

  ;; find returns the live or removed-then-reinserted slot of entry e, or 0.
  (func $find (param $e i64) (result i32)
    (local $i i32) (local $p i32) (local $k i32)
    (local.set $i (call $home (local.get $e)))
    (loop $l
      (local.set $p (call $slot (local.get $i)))
      (if (i32.eqz (i32.load16_u offset=26 (local.get $p))) (then (return (i32.const 0))))
      (if (i32.and (i32.eq (i32.load16_u offset=26 (local.get $p)) (i32.const 1))
                   (i64.eq (i64.load (local.get $p)) (local.get $e)))
        (then (return (local.get $p))))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (local.set $k (i32.add (local.get $k) (i32.const 1)))
      (br_if $l (i32.lt_u (local.get $k) (i32.const 0x10000))))
    (i32.const 0))

  ;; claim returns a free slot for a new entry e, or 0 when the table is full.
  (func $claim (param $e i64) (result i32)
    (local $i i32) (local $p i32) (local $k i32)
    (local.set $i (call $home (local.get $e)))
    (loop $l
      (local.set $p (call $slot (local.get $i)))
      (if (i32.ne (i32.load16_u offset=26 (local.get $p)) (i32.const 1)) (then (return (local.get $p))))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (local.set $k (i32.add (local.get $k) (i32.const 1)))
      (br_if $l (i32.lt_u (local.get $k) (i32.const 0x10000))))
    (i32.const 0))

  ;; AccessRecord (48 bytes): Entry @0, Time @8, Size @16, Kind @32, Mount @36.
  (func (export "kvhost_access") (param $n i32) (result i32)
    (local $r i32) (local $end i32) (local $p i32) (local $kind i32)
    (call $count)
    (local.set $r (i32.const 0x10000))
    (local.set $end (i32.add (i32.const 0x10000) (i32.mul (local.get $n) (i32.const 48))))
    (block $done
      (loop $l
        (br_if $done (i32.ge_u (local.get $r) (local.get $end)))
        (local.set $kind (i32.load offset=32 (local.get $r)))
        (local.set $p (call $find (i64.load (local.get $r))))
        (block $next
          ;; insert, restore
          (if (i32.or (i32.eq (local.get $kind) (i32.const 1)) (i32.eq (local.get $kind) (i32.const 4)))
            (then
              (if (i32.eqz (local.get $p))
                (then
                  (local.set $p (call $claim (i64.load (local.get $r))))
                  (if (i32.eqz (local.get $p)) (then (return (i32.const -2))))
                  (i64.store (local.get $p) (i64.load (local.get $r)))
                  (i32.store16 offset=24 (local.get $p) (i32.const 0))
                  (i32.store16 offset=26 (local.get $p) (i32.const 1))))
              (i64.store offset=8 (local.get $p) (i64.load offset=16 (local.get $r)))
              (i64.store offset=16 (local.get $p) (i64.load offset=8 (local.get $r)))
              (i32.store offset=28 (local.get $p) (i32.load offset=36 (local.get $r)))
              (br $next)))
          (if (i32.gt_u (local.get $kind) (i32.const 6)) (then (return (i32.const -1))))
          (if (i32.eqz (local.get $kind)) (then (return (i32.const -1))))
          (br_if $next (i32.eqz (local.get $p)))
          (if (i32.eq (local.get $kind) (i32.const 2)) ;; hit
            (then (i64.store offset=16 (local.get $p) (i64.load offset=8 (local.get $r)))))
          (if (i32.eq (local.get $kind) (i32.const 3)) ;; remove
            (then (i32.store16 offset=26 (local.get $p) (i32.const 2))))
          (if (i32.eq (local.get $kind) (i32.const 5)) ;; pin
            (then (i32.store16 offset=24 (local.get $p)
              (i32.add (i32.load16_u offset=24 (local.get $p)) (i32.const 1)))))
          (if (i32.eq (local.get $kind) (i32.const 6)) ;; unpin
            (then (if (i32.load16_u offset=24 (local.get $p))
              (then (i32.store16 offset=24 (local.get $p)
                (i32.sub (i32.load16_u offset=24 (local.get $p)) (i32.const 1))))))))
        (local.set $r (i32.add (local.get $r) (i32.const 48)))
        (br $l)))
    (i32.const 0))

  ;; EvictRequest at 0x10000: Bytes @0, Mount @16; victims (Entry, Score)
  ;; from 0x10020.
  (func (export "kvhost_evict") (param $max i32) (result i32)
    (local $i i32) (local $p i32) (local $count i32) (local $freed i64) (local $mount i32) (local $v i32)
    (call $count)
    (local.set $mount (i32.load offset=16 (i32.const 0x10000)))
    (block $done
      (loop $l
        (br_if $done (i32.ge_u (local.get $count) (local.get $max)))
        (br_if $done (i64.ge_u (local.get $freed) (i64.load (i32.const 0x10000))))
        (br_if $done (i32.ge_u (local.get $i) (i32.const 0x10000)))
        (local.set $p (call $slot (local.get $i)))
        (if (i32.and
              (i32.and (i32.eq (i32.load16_u offset=26 (local.get $p)) (i32.const 1))
                       (i32.eqz (i32.load16_u offset=24 (local.get $p))))
              (i32.or (i32.eq (local.get $mount) (i32.const -1))
                      (i32.eq (local.get $mount) (i32.load offset=28 (local.get $p)))))
          (then
            (local.set $v (i32.add (i32.const 0x10020) (i32.shl (local.get $count) (i32.const 4))))
            (i64.store (local.get $v) (i64.load (local.get $p)))
            (i64.store offset=8 (local.get $v) (i64.load offset=16 (local.get $p)))
            (local.set $freed (i64.add (local.get $freed) (i64.load offset=8 (local.get $p))))
            (local.set $count (i32.add (local.get $count) (i32.const 1)))))
        (local.set $i (i32.add (local.get $i) (i32.const 1)))
        (br $l)))
    (local.get $count))
)
