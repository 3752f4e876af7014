package meter

import "fmt"

// Opcodes the meter emits or treats specially.
const (
	opUnreachable = 0x00
	opNop         = 0x01
	opBlock       = 0x02
	opLoop        = 0x03
	opIf          = 0x04
	opElse        = 0x05
	opEnd         = 0x0b
	opLocalGet    = 0x20
	opLocalTee    = 0x22
	opGlobalGet   = 0x23
	opGlobalSet   = 0x24
	opMemoryGrow  = 0x40
	opI64Const    = 0x42
	opI64LtS      = 0x53
	opI64Sub      = 0x7d
	opI64Shl      = 0x86
	opI64ShrU     = 0x88
	opI64ExtendU  = 0xad
	opBlockEmpty  = 0x40
	prefixMisc    = 0xfc
	prefixSIMD    = 0xfd
)

// site is a place in a function body where the meter inserts code: a charge
// of a span's weight, or a charge in proportion to the i32 on top of the
// stack (a bulk operation's count).
type site struct {
	off     int   // in the body, before the instruction at off
	weight  int64 // charge sites: the weight of the span that starts here
	dynamic bool  // a charge by the count on top of the stack
	shift   int   // dynamic sites: right shift of the count (negative: left)
	keep    bool  // emitted: a function entry, a loop header, a span of weight > 0, or dynamic
}

// maxLocals bounds the locals (parameters included) of a metered function,
// the meter's two included. wazero accepts far more, and spends seconds and
// gigabytes compiling a function that declares 2^28.
const maxLocals = 50000

// control frame kinds.
const (
	frameFunc byte = iota
	frameBlock
	frameLoop
	frameIf
	frameElse

	frameTargeted byte = 0x80 // flag: a branch targets the frame's label
)

// instrumentCode appends the code section payload p, every body metered,
// to out.
func (m *module) instrumentCode(out, p []byte, fuel uint32) ([]byte, error) {
	r := reader{b: p}
	n, err := r.u32()
	if err != nil {
		return nil, err
	}
	out = appendU32(out, n)
	w := walker{globals: fuel}
	var body []byte
	for i := range n {
		fn := m.importedFuncs + int(i)
		size, err := r.u32()
		if err != nil {
			return nil, fmt.Errorf("function %d: %w", fn, err)
		}
		b, err := r.bytes(int(size))
		if err != nil {
			return nil, fmt.Errorf("function %d: %w", fn, err)
		}
		body, err = w.instrument(body[:0], b, m.types[m.funcTypes[i]], fuel)
		if err != nil {
			return nil, fmt.Errorf("function %d: %w", fn, err)
		}
		out = appendU32(out, uint32(len(body)))
		out = append(out, body...)
	}
	if r.pos != len(p) {
		return nil, fmt.Errorf("%w: %d bytes after the last function body", ErrMalformed, len(p)-r.pos)
	}
	return out, nil
}

// walker instruments function bodies; it keeps its buffers between bodies.
type walker struct {
	globals uint32 // the module's globals (imported and defined): the fuel global's index
	sites   []site
	frames  []byte
}

// instrument appends the metered version of body to out.
func (w *walker) instrument(out, body []byte, params int, fuel uint32) ([]byte, error) {
	r := reader{b: body}
	decls, err := r.u32()
	if err != nil {
		return nil, err
	}
	declsStart := r.pos
	locals := uint64(params)
	for range decls {
		c, err := r.u32()
		if err != nil {
			return nil, err
		}
		if _, err := r.valType(); err != nil {
			return nil, err
		}
		locals += uint64(c)
		if locals+2 > maxLocals {
			return nil, fmt.Errorf("%w: more than %d locals", ErrUnsupported, maxLocals-2)
		}
	}
	declsEnd := r.pos
	if err := w.scan(&r); err != nil {
		return nil, err
	}
	dynamic := false
	for _, s := range w.sites {
		dynamic = dynamic || s.dynamic
	}
	fuelLocal, countLocal := uint32(locals), uint32(locals+1)
	extra := uint32(1)
	if dynamic {
		extra = 2
	}
	out = appendU32(out, decls+extra)
	out = append(out, body[declsStart:declsEnd]...)
	out = append(out, 1, typeI64)
	if dynamic {
		out = append(out, 1, typeI32)
	}
	prev := declsEnd
	for _, s := range w.sites {
		if !s.keep {
			continue
		}
		out = append(out, body[prev:s.off]...)
		prev = s.off
		if s.dynamic {
			out = append(out, opLocalTee)
			out = appendU32(out, countLocal)
			out = append(out, opGlobalGet)
			out = appendU32(out, fuel)
			out = append(out, opLocalGet)
			out = appendU32(out, countLocal)
			out = append(out, opI64ExtendU)
			switch {
			case s.shift > 0:
				out = append(out, opI64Const, byte(s.shift), opI64ShrU)
			case s.shift < 0:
				out = append(out, opI64Const, byte(-s.shift), opI64Shl)
			}
		} else {
			out = append(out, opGlobalGet)
			out = appendU32(out, fuel)
			out = append(out, opI64Const)
			out = appendS64(out, max(s.weight, 1))
		}
		out = append(out, opI64Sub, opLocalTee)
		out = appendU32(out, fuelLocal)
		out = append(out, opGlobalSet)
		out = appendU32(out, fuel)
		out = append(out, opLocalGet)
		out = appendU32(out, fuelLocal)
		out = append(out, opI64Const, 0, opI64LtS, opIf, opBlockEmpty, opUnreachable, opEnd)
	}
	return append(out, body[prev:]...), nil
}

// scan walks the instructions from r to the end of the body and records the
// sites in w.sites.
func (w *walker) scan(r *reader) error {
	w.sites = append(w.sites[:0], site{off: r.pos, keep: true})
	w.frames = append(w.frames[:0], frameFunc)
	cur := 0      // the open charge site
	var acc int64 // the weight of its span so far
	flush := func() {
		w.sites[cur].weight = acc
		if acc > 0 {
			w.sites[cur].keep = true
		}
	}
	point := func(off int, always bool) {
		flush()
		w.sites = append(w.sites, site{off: off, keep: always})
		cur, acc = len(w.sites)-1, 0
	}
	for {
		if len(w.frames) == 0 {
			if r.pos != len(r.b) {
				return fmt.Errorf("%w: %d bytes after the body's end", ErrMalformed, len(r.b)-r.pos)
			}
			break
		}
		start := r.pos
		op, err := r.byte()
		if err != nil {
			return err
		}
		// The most frequent instructions first.
		switch {
		case op >= 0x45 && op <= 0xc4: // numeric, sign extension
			acc++
			continue
		case op >= opLocalGet && op <= opGlobalSet:
			if op < opGlobalGet {
				if err := r.skipU32(); err != nil {
					return err
				}
				continue
			}
			acc++
			g, err := r.u32()
			if err != nil {
				return err
			}
			if g >= w.globals {
				// The fuel global's index, or past it: valid only once
				// metered, and a global.set of it would refill the fuel.
				name := "get"
				if op == opGlobalSet {
					name = "set"
				}
				return fmt.Errorf("%w: global.%s of global %d; the module has %d", ErrMalformed, name, g, w.globals)
			}
			continue
		case op >= 0x28 && op <= 0x3e: // loads, stores
			acc++
			if err := r.memarg(); err != nil {
				return err
			}
			continue
		}
		weight := int64(1)
		switch op {
		case opBlock, opLoop, opIf:
			if err := r.blockType(); err != nil {
				return err
			}
			switch op {
			case opBlock:
				weight = 0
				w.frames = append(w.frames, frameBlock)
			case opLoop:
				weight = 0
				w.frames = append(w.frames, frameLoop)
				point(r.pos, true)
			case opIf:
				w.frames = append(w.frames, frameIf)
			}
		case opElse:
			if w.frames[len(w.frames)-1]&^frameTargeted != frameIf {
				return fmt.Errorf("%w: else outside if at %#x", ErrMalformed, start)
			}
			w.frames[len(w.frames)-1] = frameElse | w.frames[len(w.frames)-1]&frameTargeted
			point(r.pos, false)
			continue
		case opEnd:
			f := w.frames[len(w.frames)-1]
			w.frames = w.frames[:len(w.frames)-1]
			// Code after the end of a block is reached by a branch only if
			// one targets the block; after an if's end, always (from a
			// false condition or from the end of the then arm).
			if f == frameBlock|frameTargeted || f&^frameTargeted == frameIf || f&^frameTargeted == frameElse {
				point(r.pos, false)
				continue
			}
			weight = 0
		case opNop:
			weight = 0
		case 0x0c, 0x0d: // br, br_if
			if op == 0x0c {
				weight = 0
			}
			if err := w.target(r); err != nil {
				return err
			}
		case 0x0e: // br_table
			n, err := r.u32()
			if err != nil {
				return err
			}
			if uint64(n) >= uint64(len(r.b)-r.pos) {
				return errEOF
			}
			for range n + 1 {
				if err := w.target(r); err != nil {
					return err
				}
			}
		case 0x1a, opLocalGet, 0x21, opLocalTee, 0x41, opI64Const, 0x43, 0x44:
			// br, drop, local.get/set/tee and constants: moves the compiler
			// mostly turns into nothing.
			weight = 0
			if _, _, err := r.immediates(op, start); err != nil {
				return err
			}
		default:
			shift, dynamic, err := r.immediates(op, start)
			if err != nil {
				return err
			}
			if dynamic {
				w.sites = append(w.sites, site{off: start, dynamic: true, shift: shift, keep: true})
			}
		}
		acc += weight
	}
	flush()
	return nil
}

// target reads a branch's label and marks the frame it targets.
func (w *walker) target(r *reader) error {
	depth, err := r.u32()
	if err != nil {
		return err
	}
	if uint64(depth) >= uint64(len(w.frames)) {
		return fmt.Errorf("%w: branch to label %d at depth %d", ErrMalformed, depth, len(w.frames))
	}
	w.frames[len(w.frames)-1-int(depth)] |= frameTargeted
	return nil
}

// blockType reads a block type: empty, a value type or a type index (s33).
func (r *reader) blockType() error {
	if r.pos < len(r.b) {
		if c := r.b[r.pos]; c == opBlockEmpty || isValType(c) {
			r.pos++
			return nil
		}
	}
	v, err := r.signed(33)
	if err != nil {
		return err
	}
	if v < 0 {
		return fmt.Errorf("%w: block type %d", ErrUnsupported, v)
	}
	return nil
}

func (r *reader) memarg() error {
	if r.pos+1 < len(r.b) && r.b[r.pos] < 0x40 && r.b[r.pos+1] < 0x80 { // one-byte align and offset
		r.pos += 2
		return nil
	}
	align, err := r.u32()
	if err != nil {
		return err
	}
	if align&0x40 != 0 {
		return fmt.Errorf("%w: memory index in memarg (multiple memories)", ErrUnsupported)
	}
	_, err = r.u32()
	return err
}

// skipU32 reads a u32 immediate.
func (r *reader) skipU32() error {
	if r.pos < len(r.b) && r.b[r.pos] < 0x80 {
		r.pos++
		return nil
	}
	_, err := r.u32()
	return err
}

// skipU32s reads n u32 immediates.
func (r *reader) skipU32s(n int) error {
	for range n {
		if err := r.skipU32(); err != nil {
			return err
		}
	}
	return nil
}

// immediates reads the immediates of op (neither block, loop, if, else nor
// end), which started at offset start. dynamic reports a bulk operation
// charged by its count, with its shift.
func (r *reader) immediates(op byte, start int) (shift int, dynamic bool, err error) {
	switch {
	case op == opUnreachable || op == 0x0f /* return */ || op == 0x1a /* drop */ || op == 0x1b, /* select */
		op >= 0x45 && op <= 0xc4, /* numeric, sign extension */
		op == 0xd1:               /* ref.is_null */
		return 0, false, nil
	case op == 0x0c || op == 0x0d, /* br, br_if */
		op == 0x10,               /* call */
		op >= 0x20 && op <= 0x26, /* local.*, global.*, table.get/set */
		op == 0xd2,               /* ref.func */
		op == 0x3f:               /* memory.size */
		return 0, false, r.skipU32s(1)
	case op == opMemoryGrow:
		return shiftPages, true, r.skipU32s(1)
	case op == 0x11: /* call_indirect: type, table */
		return 0, false, r.skipU32s(2)
	case op == 0x0e: /* br_table */
		n, err := r.u32()
		if err != nil {
			return 0, false, err
		}
		if uint64(n) > uint64(len(r.b)-r.pos) {
			return 0, false, errEOF
		}
		return 0, false, r.skipU32s(int(n) + 1)
	case op == 0x1c: /* select t* */
		_, err := r.valTypes()
		return 0, false, err
	case op >= 0x28 && op <= 0x3e: /* loads, stores */
		return 0, false, r.memarg()
	case op == 0x41: /* i32.const */
		_, err := r.signed(32)
		return 0, false, err
	case op == opI64Const:
		_, err := r.signed(64)
		return 0, false, err
	case op == 0x43: /* f32.const */
		_, err := r.bytes(4)
		return 0, false, err
	case op == 0x44: /* f64.const */
		_, err := r.bytes(8)
		return 0, false, err
	case op == 0xd0: /* ref.null t */
		_, err := r.valType()
		return 0, false, err
	case op == prefixMisc:
		return r.misc(start)
	case op == prefixSIMD:
		return 0, false, r.simd(start)
	}
	return 0, false, fmt.Errorf("%w: opcode %#x (%s) at offset %#x", ErrUnsupported, op, opName(op), start)
}

// misc reads a 0xfc instruction after its prefix.
func (r *reader) misc(start int) (shift int, dynamic bool, err error) {
	sub, err := r.u32()
	if err != nil {
		return 0, false, err
	}
	switch sub {
	case 0, 1, 2, 3, 4, 5, 6, 7: // saturating truncation
		return 0, false, nil
	case 8: // memory.init data, mem
		return shiftBytes, true, r.skipU32s(2)
	case 9: // data.drop
		return 0, false, r.skipU32s(1)
	case 10: // memory.copy mem, mem
		return shiftBytes, true, r.skipU32s(2)
	case 11: // memory.fill mem
		return shiftBytes, true, r.skipU32s(1)
	case 12: // table.init elem, table
		return shiftElements, true, r.skipU32s(2)
	case 13: // elem.drop
		return 0, false, r.skipU32s(1)
	case 14: // table.copy table, table
		return shiftElements, true, r.skipU32s(2)
	case 15: // table.grow
		return shiftElements, true, r.skipU32s(1)
	case 16: // table.size
		return 0, false, r.skipU32s(1)
	case 17: // table.fill
		return shiftElements, true, r.skipU32s(1)
	}
	return 0, false, fmt.Errorf("%w: opcode 0xfc %d at offset %#x", ErrUnsupported, sub, start)
}

// simdMissing lists the unassigned opcodes below 0x100 of the 0xfd prefix.
var simdMissing = map[uint32]bool{0x9a: true, 0xa2: true, 0xa5: true, 0xa6: true, 0xaf: true, 0xb0: true,
	0xb2: true, 0xb3: true, 0xb4: true, 0xbb: true, 0xc2: true, 0xc5: true, 0xc6: true, 0xcf: true,
	0xd0: true, 0xd2: true, 0xd3: true, 0xd4: true, 0xe2: true, 0xee: true}

// simd reads a 0xfd instruction after its prefix.
func (r *reader) simd(start int) error {
	sub, err := r.u32()
	if err != nil {
		return err
	}
	switch {
	case sub <= 0x0b, sub == 0x5c, sub == 0x5d: // loads, store, load zero
		return r.memarg()
	case sub == 0x0c, sub == 0x0d: // v128.const, i8x16.shuffle
		_, err := r.bytes(16)
		return err
	case sub >= 0x15 && sub <= 0x22: // extract/replace lane
		_, err := r.byte()
		return err
	case sub >= 0x54 && sub <= 0x5b: // load/store lane
		if err := r.memarg(); err != nil {
			return err
		}
		_, err := r.byte()
		return err
	case sub < 0x100 && !simdMissing[sub]:
		return nil
	}
	return fmt.Errorf("%w: opcode 0xfd %#x (relaxed SIMD or unassigned) at offset %#x", ErrUnsupported, sub, start)
}

// opName names the single-byte opcodes the meter refuses.
func opName(op byte) string {
	switch op {
	case 0x06, 0x07, 0x08, 0x09, 0x0a, 0x18, 0x19, 0x1f:
		return "exception handling"
	case 0x12, 0x13:
		return "tail call"
	case 0x14, 0x15, 0xd3, 0xd4, 0xd5, 0xd6:
		return "typed function references"
	case 0xfb:
		return "GC"
	case 0xfe:
		return "threads/atomics"
	}
	return "unassigned"
}
