;; metered: functions for the meter's tests (built by `make wasm`).
(module
  (memory 1)
  ;; spin never returns: only the fuel stops it.
  (func (export "spin")
    (loop $l (br $l)))
  ;; deep makes 2^n calls and no loop: only the charge at function entry
  ;; stops it.
  (func $deep (export "deep") (param i32) (result i32)
    (if (result i32) (i32.eqz (local.get 0))
      (then (i32.const 1))
      (else
        (i32.add
          (call $deep (i32.sub (local.get 0) (i32.const 1)))
          (call $deep (i32.sub (local.get 0) (i32.const 1)))))))
  ;; forever recurses without end: the call stack limit stops it.
  (func $forever (export "forever") (result i32)
    (call $forever))
  ;; fill fills the whole memory page forever: bulk operations are charged
  ;; by their length.
  (func (export "fill")
    (loop $l
      (memory.fill (i32.const 0) (i32.const 7) (i32.const 65536))
      (br $l)))
  ;; count loops n times and returns n, branching through blocks on the way.
  (func (export "count") (param $n i32) (result i32) (local $i i32)
    (block $done
      (loop $l
        (br_if $done (i32.ge_u (local.get $i) (local.get $n)))
        (block $odd
          (br_if $odd (i32.and (local.get $i) (i32.const 1)))
          (nop))
        (local.set $i (i32.add (local.get $i) (i32.const 1)))
        (br $l)))
    (local.get $i))
)
