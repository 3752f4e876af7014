;; slowinit: a policy whose _initialize runs a loop of 25 million
;; iterations (about 75 million units of fuel: more than a call of 10 ms
;; gets, far less than a second's worth), and whose kvhost_init runs the
;; same loop when the configuration's first parameter is "slow=y" (the
;; value at scratch offset 5). It names nothing and evicts nothing.
(module
  (memory (export "memory") 8)
  (func $spin
    (local $i i32)
    (loop $l
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br_if $l (i32.lt_u (local.get $i) (i32.const 25000000)))))
  (func (export "_initialize") (call $spin))
  (func (export "kvhost_abi_version") (result i32) (i32.const 1))
  (func (export "kvhost_features") (result i64) (i64.const 0))
  (func (export "kvhost_scratch") (param i32) (result i32) (i32.const 0x10000))
  (func (export "kvhost_init") (param i32) (result i32)
    (if (i32.eq (i32.load8_u (i32.const 0x10005)) (i32.const 121)) (then (call $spin)))
    (i32.const 0))
  (func (export "kvhost_access") (param i32) (result i32) (i32.const 0))
  (func (export "kvhost_evict") (param i32) (result i32) (i32.const 0))
  (func (export "kvhost_name") (param i32) (result i32) (i32.const -3))
)
