;; bomb: hostile fixture. kvhost_name grows memory until the host's limit
;; refuses, then traps, as an allocator would abort.
(module
  (memory (export "memory") 8)
  (func (export "kvhost_features") (result i64) (i64.const 0))
  (func (export "kvhost_scratch") (param i32) (result i32) (i32.const 0x10000))
  (func (export "kvhost_init") (param i32) (result i32) (i32.const 0))
  (func (export "kvhost_access") (param i32) (result i32) (i32.const 0))
  (func (export "kvhost_abi_version") (result i32) (i32.const 1))
  (func (export "kvhost_evict") (param i32) (result i32) (i32.const 0))
  (func (export "kvhost_name") (param i32) (result i32)
    (loop $grow
      (br_if $grow (i32.ne (memory.grow (i32.const 16)) (i32.const -1))))
    unreachable)
)
