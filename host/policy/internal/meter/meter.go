// Package meter adds deterministic fuel metering to a WebAssembly module,
// like wasmtime's fuel: the host gives each call a budget of fuel in a global
// the module exports, the instrumented code spends it as it runs, and a call
// that runs out traps.
//
// Instrument appends one mutable i64 global, exports it as ExportName, and
// inserts a charge at the start of every function body, after every loop
// header, and at every target of a forward branch: after an else, after the
// end of an if, and after the end of a block that a branch targets. Each
// charge subtracts the weight of the code from that point to the next charge
// point (its "span") and traps with unreachable when the fuel falls below
// zero. The weight counts the instructions that do work: structural ones
// (block, loop, else, end, nop), br, drop, local.get/set/tee and constants
// weigh nothing, as the compiler mostly turns them into nothing. Every path
// between two charges runs within one span, so the fuel spent bounds the
// work done: one unit of fuel is one wasm instruction that does work. Bulk
// operations whose cost grows with an operand (memory.fill, memory.copy,
// memory.init, memory.grow, table.fill, table.copy, table.init, table.grow)
// also charge in proportion to it.
//
// Instrument also lowers the maxima of the module's tables so that they
// hold at most MaxTableElements elements together, and refuses a global
// index that only the fuel global would make valid (a module could
// otherwise set its own fuel).
//
// No function, global or type index changes, so branches, calls, the name
// section and every other section stay valid and are copied unchanged.
// Instructions outside the features the host's wazero supports (exceptions,
// tail calls, threads, GC, relaxed SIMD, ...) are refused with an error
// naming the opcode and the function, so a module is refused at load rather
// than mis-instrumented.
package meter

import (
	"errors"
	"fmt"
)

// ExportName is the export under which Instrument exposes the fuel global.
// A module that already exports this name is refused.
const ExportName = "kvhost_fuel"

// MaxTableElements bounds the elements of a module's tables, all of them
// together (Instrument lowers their maxima; see boundTables). The runtime
// keeps a table as a slice of 8-byte references in the host's memory,
// which the host's memory limit, for linear memory only, does not bound:
// 2^20 elements are 8 MiB per instance. Toolchains declare one table of
// the functions called indirectly, a few thousand for a Go plugin.
const MaxTableElements = 1 << 20

// InitialFuel is the fuel global's initial value: what a module's start
// function, which runs before the host can set the fuel, may spend.
const InitialFuel = 1 << 30

// Per-operand charges of bulk operations, as right shifts of the operand:
// one unit per 16 bytes copied or filled (memory runs at tens of bytes per
// nanosecond, simple instructions at about one per nanosecond), one per
// table element, and 4096 per 64 KiB page grown.
const (
	shiftBytes    = 4
	shiftElements = 0
	shiftPages    = -12 // a left shift: pages << 12
)

// Errors returned by Instrument wrap one of these.
var (
	// ErrMalformed: the module is not a well-formed WebAssembly binary.
	ErrMalformed = errors.New("meter: malformed module")
	// ErrUnsupported: the module uses a feature the meter does not
	// instrument (and the host does not run).
	ErrUnsupported = errors.New("meter: unsupported feature")
	// ErrReserved: the module already exports ExportName.
	ErrReserved = errors.New("meter: reserved export name " + ExportName)
	// ErrLimit: the module declares more than the host bounds
	// (MaxTableElements).
	ErrLimit = errors.New("meter: over a limit")
)

// Section ids.
const (
	secCustom    = 0
	secType      = 1
	secImport    = 2
	secFunction  = 3
	secTable     = 4
	secMemory    = 5
	secGlobal    = 6
	secExport    = 7
	secStart     = 8
	secElement   = 9
	secCode      = 10
	secData      = 11
	secDataCount = 12
)

// rank is the position of each known non-custom section in the required
// order; 0 for unknown ids.
var rank = [...]int{secType: 1, secImport: 2, secFunction: 3, secTable: 4, secMemory: 5,
	secGlobal: 6, secExport: 7, secStart: 8, secElement: 9, secDataCount: 10, secCode: 11, secData: 12}

// sectionNames names the sections in errors.
var sectionNames = [...]string{secCustom: "custom", secType: "type", secImport: "import", secFunction: "function",
	secTable: "table", secMemory: "memory", secGlobal: "global", secExport: "export", secStart: "start",
	secElement: "element", secCode: "code", secData: "data", secDataCount: "data count"}

// Value types.
const (
	typeI32       = 0x7f
	typeI64       = 0x7e
	typeF32       = 0x7d
	typeF64       = 0x7c
	typeV128      = 0x7b
	typeFuncref   = 0x70
	typeExternref = 0x6f
)

func isValType(b byte) bool {
	switch b {
	case typeI32, typeI64, typeF32, typeF64, typeV128, typeFuncref, typeExternref:
		return true
	}
	return false
}

var magic = []byte{0x00, 'a', 's', 'm', 0x01, 0x00, 0x00, 0x00}

// section is one section of the input module.
type section struct {
	id      byte
	payload []byte
}

// module is what Instrument needs to know about the input.
type module struct {
	sections      []section
	types         []int    // parameter count per function type
	funcTypes     []uint32 // type index per defined function
	importedFuncs int
	globals       int // imported and defined
	hasGlobalSec  bool
	hasExportSec  bool
}

// Instrument returns module with fuel metering added (see the package
// documentation). The output is a deterministic function of the input. It
// returns an error wrapping ErrMalformed, ErrUnsupported or ErrReserved
// when the module cannot be instrumented.
func Instrument(wasm []byte) ([]byte, error) {
	m, err := parse(wasm)
	if err != nil {
		return nil, err
	}
	fuel := uint32(m.globals)
	out := make([]byte, 0, len(wasm)+len(wasm)/2+64)
	out = append(out, magic...)
	addGlobal := func() {
		out = appendSection(out, secGlobal, appendFuelGlobal(appendU32(nil, 1)))
	}
	addExport := func() {
		out = appendSection(out, secExport, appendFuelExport(appendU32(nil, 1), fuel))
	}
	pendingGlobal, pendingExport := !m.hasGlobalSec, !m.hasExportSec
	for _, s := range m.sections {
		if s.id != secCustom {
			if pendingGlobal && rank[s.id] > rank[secGlobal] {
				addGlobal()
				pendingGlobal = false
			}
			if pendingExport && rank[s.id] > rank[secExport] {
				addExport()
				pendingExport = false
			}
		}
		switch s.id {
		case secTable:
			p, err := boundTables(s.payload)
			if err != nil {
				return nil, fmt.Errorf("table section: %w", err)
			}
			out = appendSection(out, s.id, p)
		case secGlobal:
			p, err := appendToVec(s.payload, appendFuelGlobal)
			if err != nil {
				return nil, err
			}
			out = appendSection(out, s.id, p)
		case secExport:
			p, err := appendToVec(s.payload, func(b []byte) []byte { return appendFuelExport(b, fuel) })
			if err != nil {
				return nil, err
			}
			out = appendSection(out, s.id, p)
		case secCode:
			// Written in place, the size after it: this section is most
			// of the module.
			out = append(out, s.id)
			mark := len(out)
			out = append(out, 0, 0, 0, 0, 0)
			if out, err = m.instrumentCode(out, s.payload, fuel); err != nil {
				return nil, err
			}
			size := appendU32(nil, uint32(len(out)-mark-5))
			copy(out[mark+len(size):], out[mark+5:])
			copy(out[mark:], size)
			out = out[:len(out)-5+len(size)]
		default:
			out = appendSection(out, s.id, s.payload)
		}
	}
	if pendingGlobal {
		addGlobal()
	}
	if pendingExport {
		addExport()
	}
	return out, nil
}

// parse splits wasm into sections and reads the types, imports, functions,
// globals and exports.
func parse(wasm []byte) (*module, error) {
	if len(wasm) < len(magic) || string(wasm[:4]) != string(magic[:4]) {
		return nil, fmt.Errorf("%w: no wasm magic number", ErrMalformed)
	}
	if string(wasm[4:8]) != string(magic[4:]) {
		return nil, fmt.Errorf("%w: binary format version %x, want 1", ErrUnsupported, wasm[4:8])
	}
	m := &module{}
	r := reader{b: wasm, pos: len(magic)}
	last := 0
	codeCount := -1
	for r.pos < len(r.b) {
		id, err := r.byte()
		if err != nil {
			return nil, err
		}
		size, err := r.u32()
		if err != nil {
			return nil, err
		}
		payload, err := r.bytes(int(size))
		if err != nil {
			return nil, fmt.Errorf("%w: section %d: %v", ErrMalformed, id, err)
		}
		if id != secCustom {
			if int(id) >= len(rank) || rank[id] == 0 {
				return nil, fmt.Errorf("%w: section id %d", ErrUnsupported, id)
			}
			if rank[id] <= last {
				return nil, fmt.Errorf("%w: section %d out of order or repeated", ErrMalformed, id)
			}
			last = rank[id]
		}
		sr := reader{b: payload}
		switch id {
		case secCustom:
			if _, err := sr.name(); err != nil {
				return nil, fmt.Errorf("%w: custom section name: %v", ErrMalformed, err)
			}
		case secType:
			err = m.parseTypes(&sr)
		case secImport:
			err = m.parseImports(&sr)
		case secFunction:
			err = m.parseFunctions(&sr)
		case secGlobal:
			var n uint32
			n, err = sr.u32()
			m.globals += int(n)
			m.hasGlobalSec = true
		case secExport:
			err = m.parseExports(&sr)
			m.hasExportSec = true
		case secCode:
			var n uint32
			n, err = sr.u32()
			codeCount = int(n)
		}
		if err != nil {
			return nil, fmt.Errorf("%s section: %w", sectionNames[id], err)
		}
		m.sections = append(m.sections, section{id: id, payload: payload})
	}
	if codeCount < 0 {
		codeCount = 0
	}
	if codeCount != len(m.funcTypes) {
		return nil, fmt.Errorf("%w: %d function declarations but %d bodies", ErrMalformed, len(m.funcTypes), codeCount)
	}
	if uint64(m.globals) >= 1<<32-1 {
		return nil, fmt.Errorf("%w: %d globals", ErrMalformed, m.globals)
	}
	return m, nil
}

func (m *module) parseTypes(r *reader) error {
	n, err := r.u32()
	if err != nil {
		return err
	}
	for i := range n {
		form, err := r.byte()
		if err != nil {
			return err
		}
		if form != 0x60 {
			return fmt.Errorf("%w: type %d has form %#x, not a function type (GC types)", ErrUnsupported, i, form)
		}
		params, err := r.valTypes()
		if err != nil {
			return fmt.Errorf("type %d: %w", i, err)
		}
		if _, err := r.valTypes(); err != nil {
			return fmt.Errorf("type %d: %w", i, err)
		}
		m.types = append(m.types, params)
	}
	return nil
}

func (m *module) parseImports(r *reader) error {
	n, err := r.u32()
	if err != nil {
		return err
	}
	for i := range n {
		if _, err := r.name(); err != nil {
			return err
		}
		if _, err := r.name(); err != nil {
			return err
		}
		kind, err := r.byte()
		if err != nil {
			return err
		}
		switch kind {
		case 0x00: // function
			if _, err := r.u32(); err != nil {
				return err
			}
			m.importedFuncs++
		case 0x01: // table
			if _, err := r.valType(); err != nil {
				return err
			}
			_, _, _, err = r.limits()
		case 0x02: // memory
			_, _, _, err = r.limits()
		case 0x03: // global
			if _, err := r.valType(); err != nil {
				return err
			}
			var mut byte
			if mut, err = r.byte(); err == nil && mut > 1 {
				err = fmt.Errorf("%w: global mutability %#x", ErrMalformed, mut)
			}
			m.globals++
		default:
			return fmt.Errorf("%w: import %d has kind %#x (exceptions?)", ErrUnsupported, i, kind)
		}
		if err != nil {
			return fmt.Errorf("import %d: %w", i, err)
		}
	}
	return nil
}

func (m *module) parseFunctions(r *reader) error {
	n, err := r.u32()
	if err != nil {
		return err
	}
	if uint64(n) > uint64(len(r.b)) { // each takes at least one byte
		return fmt.Errorf("%w: %d functions in %d bytes", ErrMalformed, n, len(r.b))
	}
	m.funcTypes = make([]uint32, n)
	for i := range m.funcTypes {
		t, err := r.u32()
		if err != nil {
			return err
		}
		if int(t) >= len(m.types) || int(t) < 0 {
			return fmt.Errorf("%w: function %d has type %d of %d", ErrMalformed, m.importedFuncs+i, t, len(m.types))
		}
		m.funcTypes[i] = t
	}
	return nil
}

func (m *module) parseExports(r *reader) error {
	n, err := r.u32()
	if err != nil {
		return err
	}
	for range n {
		name, err := r.name()
		if err != nil {
			return err
		}
		if string(name) == ExportName {
			return ErrReserved
		}
		kind, err := r.byte()
		if err != nil {
			return err
		}
		idx, err := r.u32()
		if err != nil {
			return err
		}
		if kind == 0x03 && int(idx) >= m.globals { // the fuel global's index, or past it
			return fmt.Errorf("%w: export %q of global %d; the module has %d", ErrMalformed, name, idx, m.globals)
		}
	}
	return nil
}

// boundTables returns the table section payload p with every table's
// maximum lowered so that the tables' maxima add up to at most
// MaxTableElements: each table gets its minimum and an equal share of
// what the minima leave. A table.grow past its maximum fails (returns
// -1), as a memory.grow past the host's memory limit does. Minima that
// add up to more are refused.
func boundTables(p []byte) ([]byte, error) {
	r := reader{b: p}
	n, err := r.u32()
	if err != nil {
		return nil, err
	}
	type table struct {
		ref    byte
		lo, hi uint32
		hasMax bool
	}
	tables := make([]table, 0, min(n, 16))
	var sum uint64
	for i := range n {
		ref, err := r.byte()
		if err != nil {
			return nil, err
		}
		if ref != typeFuncref && ref != typeExternref {
			return nil, fmt.Errorf("%w: table %d of type %#x", ErrMalformed, i, ref)
		}
		lo, hi, hasMax, err := r.limits()
		if err != nil {
			return nil, fmt.Errorf("table %d: %w", i, err)
		}
		if hasMax && hi < lo {
			return nil, fmt.Errorf("%w: table %d: maximum %d below its minimum %d", ErrMalformed, i, hi, lo)
		}
		sum += uint64(lo)
		if sum > MaxTableElements {
			return nil, fmt.Errorf("%w: tables of more than %d elements at start", ErrLimit, MaxTableElements)
		}
		tables = append(tables, table{ref, lo, hi, hasMax})
	}
	if r.pos != len(p) {
		return nil, fmt.Errorf("%w: %d bytes after the last table", ErrMalformed, len(p)-r.pos)
	}
	out := appendU32(make([]byte, 0, len(p)+4*len(tables)), n)
	if n == 0 {
		return out, nil
	}
	share := (MaxTableElements - sum) / uint64(n)
	for _, t := range tables {
		hi := uint64(t.lo) + share
		if t.hasMax && uint64(t.hi) < hi {
			hi = uint64(t.hi)
		}
		out = append(out, t.ref, 0x01)
		out = appendU32(appendU32(out, t.lo), uint32(hi))
	}
	return out, nil
}

// appendToVec returns the vector payload p with one more element, appended
// by add.
func appendToVec(p []byte, add func([]byte) []byte) ([]byte, error) {
	r := reader{b: p}
	n, err := r.u32()
	if err != nil {
		return nil, err
	}
	if n == 1<<32-1 {
		return nil, fmt.Errorf("%w: vector of %d elements", ErrMalformed, n)
	}
	out := appendU32(make([]byte, 0, len(p)+16), n+1)
	out = append(out, p[r.pos:]...)
	return add(out), nil
}

// appendFuelGlobal appends the fuel global: mutable i64 = InitialFuel.
func appendFuelGlobal(b []byte) []byte {
	b = append(b, typeI64, 0x01, opI64Const)
	return append(appendS64(b, InitialFuel), opEnd)
}

// appendFuelExport appends the export of global fuel as ExportName.
func appendFuelExport(b []byte, fuel uint32) []byte {
	b = appendU32(b, uint32(len(ExportName)))
	b = append(b, ExportName...)
	b = append(b, 0x03) // global
	return appendU32(b, fuel)
}

func appendSection(out []byte, id byte, payload []byte) []byte {
	out = append(out, id)
	out = appendU32(out, uint32(len(payload)))
	return append(out, payload...)
}
