;; A kvhost placement policy written by hand in WebAssembly text, against
;; ABI v1 (docs/abi.md). It is the vendor example in a second language:
;; everything a plugin needs, with no SDK and no imports.
;;
;;   naming    "wat/<key hash as 16 hex>.kv", mount = key hash % mount count
;;   tracking  a fixed-size open-addressing table of entries (id, size, mount,
;;             pins), and a ring of entry ids in insertion order
;;   eviction  FIFO: unpinned entries on the requested mount, oldest insert
;;             first, until their sizes cover the bytes asked for
;;
;; Build:  wat2wasm policy.wat -o policy.wasm
;;
;; Memory map (46 pages of 64 KiB, fixed; the module never grows memory):
;;
;;   0x000400  scratch area, SCRATCH_SIZE = 1024 * 368 + 32 = 376864 bytes
;;             (abi.MaxBatch name records, the largest batch of any hook)
;;   0x060000  entry table: 65536 slots of 32 bytes
;;               +0 id    i64   AccessRecord.Entry
;;               +8 size  i64   bytes on disk
;;              +16 mount i32
;;              +20 pins  i32   AccessPin minus AccessUnpin
;;              +24 used  i32   1: slot holds an entry; 0: empty
;;   0x260000  FIFO ring: 65536 entry ids (i64), insertion order
;;   0x2E0000  end
;;
;; The table holds at most MAX_LIVE = 49152 entries (75% load, so linear
;; probing stays short); an insert beyond that fails with status -2
;; (no memory), which the host treats as a failure of the plugin.
;;
;; Record offsets used below (all little-endian, from docs/abi.md):
;;   NameRecord (368 bytes):   KeyHash u64 @8, MountCount u32 @28,
;;                             Mount u32 @96, PathLen u32 @100, Path @112
;;   AccessRecord (48 bytes):  Entry u64 @0, Size u64 @16, Kind u32 @32,
;;                             Mount u32 @36
;;   EvictRequest (32 bytes):  Bytes u64 @0, Mount u32 @16; victims follow
;;   Victim (16 bytes):        Entry u64 @0, Score u64 @8
(module
  (memory (export "memory") 46 46)

  ;; Layout constants.
  (global $SCRATCH i32 (i32.const 0x400))
  (global $SCRATCH_SIZE i32 (i32.const 376864))
  (global $TABLE i32 (i32.const 0x60000))
  (global $TABLE_MASK i32 (i32.const 65535))   ;; slots - 1
  (global $MAX_LIVE i32 (i32.const 49152))
  (global $RING i32 (i32.const 0x260000))
  (global $RING_SIZE i64 (i64.const 65536))
  (global $MAX_BATCH i32 (i32.const 1024))

  ;; State.
  (global $live (mut i32) (i32.const 0))       ;; entries in the table
  (global $head (mut i64) (i64.const 0))       ;; ring: oldest position
  (global $tail (mut i64) (i64.const 0))       ;; ring: next free position

  ;; Status codes.
  (global $OK i32 (i32.const 0))
  (global $INVALID i32 (i32.const -1))
  (global $NO_MEMORY i32 (i32.const -2))

  ;; ---------------------------------------------------------------------
  ;; Exports every ABI v1 plugin has.

  ;; kvhost_abi_version() -> i32: the ABI this module implements.
  (func (export "kvhost_abi_version") (result i32) (i32.const 1))

  ;; kvhost_features() -> i64: no optional hooks (no kvhost_namespace, so
  ;; the host uses the default layout; no kvhost_admit, so every store is
  ;; admitted).
  (func (export "kvhost_features") (result i64) (i64.const 0))

  ;; kvhost_scratch(min_bytes) -> pointer to a scratch area of at least
  ;; min_bytes, 8-aligned; 0 if it cannot provide one. Ours is fixed.
  (func (export "kvhost_scratch") (param $min i32) (result i32)
    (if (i32.or (i32.lt_s (local.get $min) (i32.const 0))
                (i32.gt_s (local.get $min) (global.get $SCRATCH_SIZE)))
      (then (return (i32.const 0))))
    (global.get $SCRATCH))

  ;; kvhost_init(config_len) -> status. The configuration ("key=value"
  ;; lines in the scratch area) has no keys this policy reads.
  (func (export "kvhost_init") (param $len i32) (result i32)
    (if (i32.or (i32.lt_s (local.get $len) (i32.const 0))
                (i32.gt_s (local.get $len) (global.get $SCRATCH_SIZE)))
      (then (return (global.get $INVALID))))
    (global.get $OK))

  ;; ---------------------------------------------------------------------
  ;; kvhost_name(n) -> status: name the n NameRecords in the scratch area.

  (func (export "kvhost_name") (param $n i32) (result i32)
    (local $rec i32) (local $end i32) (local $hash i64) (local $mounts i32)
    (local $p i32) (local $k i32)
    (if (i32.or (i32.lt_s (local.get $n) (i32.const 0))
                (i32.gt_s (local.get $n) (global.get $MAX_BATCH)))
      (then (return (global.get $INVALID))))
    (local.set $rec (global.get $SCRATCH))
    (local.set $end (i32.add (global.get $SCRATCH) (i32.mul (local.get $n) (i32.const 368))))
    (block $done
      (loop $each
        (br_if $done (i32.ge_u (local.get $rec) (local.get $end)))
        (local.set $hash (i64.load offset=8 (local.get $rec)))
        ;; Mount = hash % MountCount (0 when the host reports no mounts).
        (local.set $mounts (i32.load offset=28 (local.get $rec)))
        (i32.store offset=96 (local.get $rec)
          (if (result i32) (i32.eqz (local.get $mounts))
            (then (i32.const 0))
            (else (i32.wrap_i64 (i64.rem_u (local.get $hash)
                                           (i64.extend_i32_u (local.get $mounts)))))))
        ;; Path = "wat/" + 16 hex digits (most significant first) + ".kv".
        (local.set $p (i32.add (local.get $rec) (i32.const 112)))
        (i32.store (local.get $p) (i32.const 0x2f746177))         ;; "wat/"
        (local.set $k (i32.const 0))
        (block $hexdone
          (loop $hex
            (br_if $hexdone (i32.ge_u (local.get $k) (i32.const 16)))
            (i32.store8 offset=4 (i32.add (local.get $p) (local.get $k))
              (call $hexdigit
                (i32.wrap_i64 (i64.and
                  (i64.shr_u (local.get $hash)
                             (i64.extend_i32_u (i32.sub (i32.const 60) (i32.mul (local.get $k) (i32.const 4)))))
                  (i64.const 15)))))
            (local.set $k (i32.add (local.get $k) (i32.const 1)))
            (br $hex)))
        (i32.store16 offset=20 (local.get $p) (i32.const 0x6b2e))  ;; ".k"
        (i32.store8 offset=22 (local.get $p) (i32.const 0x76))     ;; "v"
        (i32.store offset=100 (local.get $rec) (i32.const 23))     ;; PathLen
        (local.set $rec (i32.add (local.get $rec) (i32.const 368)))
        (br $each)))
    (global.get $OK))

  (func $hexdigit (param $v i32) (result i32)
    (if (result i32) (i32.lt_u (local.get $v) (i32.const 10))
      (then (i32.add (local.get $v) (i32.const 0x30)))          ;; '0'..'9'
      (else (i32.add (local.get $v) (i32.const 0x57)))))        ;; 'a'..'f'

  ;; ---------------------------------------------------------------------
  ;; Entry table: open addressing with linear probing, keyed by entry id.

  ;; Address of slot $i.
  (func $slot (param $i i32) (result i32)
    (i32.add (global.get $TABLE) (i32.shl (local.get $i) (i32.const 5))))

  ;; Home slot of an id (Fibonacci hashing: the top 16 bits of id * 2^64/phi).
  (func $home (param $id i64) (result i32)
    (i32.wrap_i64 (i64.shr_u (i64.mul (local.get $id) (i64.const 0x9E3779B97F4A7C15))
                             (i64.const 48))))

  ;; Address of the entry with this id, or 0 if there is none.
  (func $find (param $id i64) (result i32)
    (local $i i32) (local $a i32)
    (local.set $i (call $home (local.get $id)))
    (loop $probe
      (local.set $a (call $slot (local.get $i)))
      (if (i32.eqz (i32.load offset=24 (local.get $a)))
        (then (return (i32.const 0))))
      (if (i64.eq (i64.load (local.get $a)) (local.get $id))
        (then (return (local.get $a))))
      (local.set $i (i32.and (i32.add (local.get $i) (i32.const 1)) (global.get $TABLE_MASK)))
      (br $probe))
    (unreachable))

  ;; Add an entry that is not in the table; append its id to the ring.
  ;; Returns its address, or 0 when the table or the ring is full.
  (func $add (param $id i64) (result i32)
    (local $i i32) (local $a i32)
    (if (i32.ge_u (global.get $live) (global.get $MAX_LIVE))
      (then (return (i32.const 0))))
    (if (i32.eqz (call $ring_push (local.get $id)))
      (then (return (i32.const 0))))
    (local.set $i (call $home (local.get $id)))
    (loop $probe
      (local.set $a (call $slot (local.get $i)))
      (if (i32.load offset=24 (local.get $a))
        (then
          (local.set $i (i32.and (i32.add (local.get $i) (i32.const 1)) (global.get $TABLE_MASK)))
          (br $probe))))
    (i64.store (local.get $a) (local.get $id))
    (i64.store offset=8 (local.get $a) (i64.const 0))
    (i32.store offset=16 (local.get $a) (i32.const 0))
    (i32.store offset=20 (local.get $a) (i32.const 0))
    (i32.store offset=24 (local.get $a) (i32.const 1))
    (global.set $live (i32.add (global.get $live) (i32.const 1)))
    (local.get $a))

  ;; Remove the entry in slot $i, shifting later members of its probe run
  ;; back so that lookups never need tombstones.
  (func $remove (param $i i32)
    (local $j i32) (local $home i32) (local $a i32) (local $b i32)
    (local.set $j (local.get $i))
    (block $end
      (loop $shift
        (local.set $j (i32.and (i32.add (local.get $j) (i32.const 1)) (global.get $TABLE_MASK)))
        (local.set $b (call $slot (local.get $j)))
        (br_if $end (i32.eqz (i32.load offset=24 (local.get $b))))
        (local.set $home (call $home (i64.load (local.get $b))))
        ;; Move j into the hole at i unless j's home lies in (i, j].
        (if (i32.ge_u (i32.and (i32.sub (local.get $j) (local.get $home)) (global.get $TABLE_MASK))
                      (i32.and (i32.sub (local.get $j) (local.get $i)) (global.get $TABLE_MASK)))
          (then
            (local.set $a (call $slot (local.get $i)))
            (memory.copy (local.get $a) (local.get $b) (i32.const 32))
            (local.set $i (local.get $j))))
        (br $shift)))
    (i32.store offset=24 (call $slot (local.get $i)) (i32.const 0))
    (global.set $live (i32.sub (global.get $live) (i32.const 1))))

  ;; ---------------------------------------------------------------------
  ;; FIFO ring of entry ids. Removed entries stay in the ring until the
  ;; eviction walk or a compaction skips them (an id is never reused, so an
  ;; id that is not in the table is simply gone).

  (func $ring_at (param $pos i64) (result i32)
    (i32.add (global.get $RING)
             (i32.shl (i32.wrap_i64 (i64.rem_u (local.get $pos) (global.get $RING_SIZE)))
                      (i32.const 3))))

  ;; Append an id; compacts the ring first if it is full. Returns 0 if full.
  (func $ring_push (param $id i64) (result i32)
    (if (i64.ge_u (i64.sub (global.get $tail) (global.get $head)) (global.get $RING_SIZE))
      (then (call $ring_compact)))
    (if (i64.ge_u (i64.sub (global.get $tail) (global.get $head)) (global.get $RING_SIZE))
      (then (return (i32.const 0))))
    (i64.store (call $ring_at (global.get $tail)) (local.get $id))
    (global.set $tail (i64.add (global.get $tail) (i64.const 1)))
    (i32.const 1))

  ;; Drop the ids of removed entries, keeping the order of the others.
  (func $ring_compact
    (local $r i64) (local $w i64) (local $id i64)
    (local.set $r (global.get $head))
    (local.set $w (global.get $head))
    (block $done
      (loop $each
        (br_if $done (i64.ge_u (local.get $r) (global.get $tail)))
        (local.set $id (i64.load (call $ring_at (local.get $r))))
        (if (call $find (local.get $id))
          (then
            (i64.store (call $ring_at (local.get $w)) (local.get $id))
            (local.set $w (i64.add (local.get $w) (i64.const 1)))))
        (local.set $r (i64.add (local.get $r) (i64.const 1)))
        (br $each)))
    (global.set $tail (local.get $w)))

  ;; ---------------------------------------------------------------------
  ;; kvhost_access(n) -> status: apply the n AccessRecords in the scratch area.

  (func (export "kvhost_access") (param $n i32) (result i32)
    (local $rec i32) (local $end i32) (local $kind i32) (local $id i64) (local $a i32)
    (if (i32.or (i32.lt_s (local.get $n) (i32.const 0))
                (i32.gt_s (local.get $n) (global.get $MAX_BATCH)))
      (then (return (global.get $INVALID))))
    (local.set $rec (global.get $SCRATCH))
    (local.set $end (i32.add (global.get $SCRATCH) (i32.mul (local.get $n) (i32.const 48))))
    (block $done
      (loop $each
        (br_if $done (i32.ge_u (local.get $rec) (local.get $end)))
        (local.set $id (i64.load (local.get $rec)))
        (local.set $kind (i32.load offset=32 (local.get $rec)))
        (local.set $a (call $find (local.get $id)))
        (block $next
          ;; 3 remove: forget the entry (unknown ids are ignored).
          (if (i32.eq (local.get $kind) (i32.const 3))
            (then
              (if (local.get $a)
                (then (call $remove (i32.shr_u (i32.sub (local.get $a) (global.get $TABLE)) (i32.const 5)))))
              (br $next)))
          ;; 6 unpin: release one pin (an unpin without a pin is ignored).
          (if (i32.eq (local.get $kind) (i32.const 6))
            (then
              (if (i32.and (i32.ne (local.get $a) (i32.const 0))
                           (i32.ne (i32.load offset=20 (local.get $a)) (i32.const 0)))
                (then (i32.store offset=20 (local.get $a)
                        (i32.sub (i32.load offset=20 (local.get $a)) (i32.const 1)))))
              (br $next)))
          ;; Anything else must be 1 insert, 2 hit, 4 restore or 5 pin.
          (if (i32.or (i32.eqz (local.get $kind))
                      (i32.gt_u (local.get $kind) (i32.const 5)))
            (then (return (global.get $INVALID))))
          ;; Learn an unknown entry (with the record's size and mount); FIFO
          ;; order is the order entries are learnt.
          (if (i32.eqz (local.get $a))
            (then
              (local.set $a (call $add (local.get $id)))
              (if (i32.eqz (local.get $a))
                (then (return (global.get $NO_MEMORY))))
              (i64.store offset=8 (local.get $a) (i64.load offset=16 (local.get $rec)))
              (i32.store offset=16 (local.get $a) (i32.load offset=36 (local.get $rec)))))
          ;; 5 pin: pins nest.
          (if (i32.eq (local.get $kind) (i32.const 5))
            (then
              (i32.store offset=20 (local.get $a)
                (i32.add (i32.load offset=20 (local.get $a)) (i32.const 1)))))
          ;; 1 insert, 4 restore: record where the entry is and how big it
          ;; is. A hit (2) on a known entry changes nothing: FIFO ignores
          ;; hits, and hosts need not repeat the size in hit records.
          (if (i32.or (i32.eq (local.get $kind) (i32.const 1))
                      (i32.eq (local.get $kind) (i32.const 4)))
            (then
              (i64.store offset=8 (local.get $a) (i64.load offset=16 (local.get $rec)))
              (i32.store offset=16 (local.get $a) (i32.load offset=36 (local.get $rec))))))
        (local.set $rec (i32.add (local.get $rec) (i32.const 48)))
        (br $each)))
    (global.get $OK))

  ;; ---------------------------------------------------------------------
  ;; kvhost_evict(max) -> number of victims written, or a status < 0.
  ;; The EvictRequest is at the start of the scratch area; victims go right
  ;; after it. Score is the ring position: lower = inserted earlier.

  (func (export "kvhost_evict") (param $max i32) (result i32)
    (local $want i64) (local $mount i32) (local $freed i64) (local $count i32)
    (local $pos i64) (local $id i64) (local $a i32) (local $out i32) (local $prefix i32)
    (if (i32.or (i32.lt_s (local.get $max) (i32.const 0))
                (i32.gt_s (local.get $max) (global.get $MAX_BATCH)))
      (then (return (global.get $INVALID))))
    (local.set $want (i64.load (global.get $SCRATCH)))
    (local.set $mount (i32.load offset=16 (global.get $SCRATCH)))
    (local.set $out (i32.add (global.get $SCRATCH) (i32.const 32)))
    (local.set $pos (global.get $head))
    (local.set $prefix (i32.const 1))   ;; still in the removed ids at the head?
    (block $done
      (loop $walk
        (br_if $done (i64.ge_u (local.get $pos) (global.get $tail)))
        (br_if $done (i32.ge_u (local.get $count) (local.get $max)))
        (br_if $done (i64.ge_u (local.get $freed) (local.get $want)))
        (local.set $id (i64.load (call $ring_at (local.get $pos))))
        (local.set $a (call $find (local.get $id)))
        (if (i32.eqz (local.get $a))
          (then
            ;; A removed entry: drop it from the ring if nothing live precedes it.
            (if (local.get $prefix)
              (then (global.set $head (i64.add (local.get $pos) (i64.const 1))))))
          (else
            (local.set $prefix (i32.const 0))
            ;; Eligible: unpinned, and on the requested mount (0xFFFFFFFF: any).
            (if (i32.and (i32.eqz (i32.load offset=20 (local.get $a)))
                         (i32.or (i32.eq (local.get $mount) (i32.const -1))
                                 (i32.eq (local.get $mount) (i32.load offset=16 (local.get $a)))))
              (then
                (i64.store (local.get $out) (local.get $id))
                (i64.store offset=8 (local.get $out) (local.get $pos))
                (local.set $out (i32.add (local.get $out) (i32.const 16)))
                (local.set $count (i32.add (local.get $count) (i32.const 1)))
                (local.set $freed (i64.add (local.get $freed) (i64.load offset=8 (local.get $a))))))))
        (local.set $pos (i64.add (local.get $pos) (i64.const 1)))
        (br $walk)))
    (local.get $count))
)
