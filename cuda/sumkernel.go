package cuda

import (
	"encoding/binary"
	"fmt"
	"strings"
	"unsafe"

	"github.com/kvhost/kvhost/internal/crc32c"
)

// Checksum kernel limits: every address and length must be a multiple of
// SumAlign and a length at most SumMaxLen; one launch checksums at most
// SumMaxEntries spans, each described by SumEntryBytes of its table.
const (
	SumAlign      = 16
	SumMaxLen     = 64 << 10
	SumEntryBytes = 16
	SumMaxEntries = 65535 // a grid's y dimension
)

// Launch shape of the checksum kernel: one block of sumThreads threads
// per span, each thread reading 16 bytes per round of sumRound bytes.
const (
	sumThreads = 256
	sumRound   = sumThreads * SumAlign
)

// sumKernelName is the entry point in the checksum kernel's PTX.
const sumKernelName = "kv_crc32c_spans"

// The kernel's lookup tables, each the CRC register shifted past a number
// of bytes (crc32c.Shift) as a linear map of the register's four bytes:
// table(n)[k][b] = Shift(b<<8k, n), 4·256 words per n. Group 0 (n = 4)
// folds a 4-byte word into the register, group 1 (n = sumRound-16)
// carries a thread's register over the other threads' bytes of a round,
// and group 2+l (n = 16·2^l) joins two halves of the block's registers at
// level l of the reduction. The kernel copies groups 0 and 1 to shared
// memory; the reduction's groups, used once a level, stay in global.
const (
	sumGroupWords  = 4 * 256
	sumLevels      = 8 // log2(sumThreads)
	sumSharedWords = 2 * sumGroupWords
	sumTableWords  = (2 + sumLevels) * sumGroupWords
)

// sumTables returns the kernel's lookup tables, group by group.
func sumTables() []uint32 {
	t := make([]uint32, 0, sumTableWords)
	group := func(n int64) {
		for k := range 4 {
			for b := range 256 {
				t = append(t, crc32c.Shift(uint32(b)<<(8*k), n))
			}
		}
	}
	group(4)
	group(sumRound - SumAlign)
	for l := range sumLevels {
		group(SumAlign << l)
	}
	return t
}

// sumKernelPTX returns the checksum kernel, written in PTX by hand (its
// repeated table lookups spelled out by sharedLookups and globalLookups)
// and compiled by the driver's JIT, as the copy kernel is. Block y reads entry y of the table
// (address: u64, length: u32, register: u32, little-endian) and writes
// the CRC-32C register of the span's bytes (crc32c.Register) into the
// entry's last word.
//
// The span is taken as left-padded with zeros to whole rounds of
// sumRound bytes: leading zeros leave a register from 0 at 0, so the
// register is unchanged, and every round is whole. In each round thread t
// reads the 16 bytes at 16t, shifts its register past the round's other
// bytes (group 1) and folds in its four words (group 0): after the last
// round its register is that of its own bytes, each round's shifted past
// the following rounds. A reduction then joins the registers pairwise,
// the earlier one shifted past the later one's 16·2^l bytes (group 2+l),
// until thread 0 holds the span's. TestSumKernelAlgorithm runs the same
// steps in Go; the PTX itself runs only on a GPU (scripts/gpu-check.sh).
func sumKernelPTX() string {
	var b strings.Builder
	w := func(format string, args ...any) { fmt.Fprintf(&b, format+"\n", args...) }
	w(".version 7.0\n.target sm_75\n.address_size 64\n")
	w(".global .align 16 .u32 kv_crc_tab[%d] = {", sumTableWords)
	t := sumTables()
	for i := 0; i < len(t); i += 8 {
		var row []string
		for _, v := range t[i : i+8] {
			row = append(row, fmt.Sprintf("0x%08X", v))
		}
		sep := ","
		if i+8 == len(t) {
			sep = ""
		}
		w("\t%s%s", strings.Join(row, ", "), sep)
	}
	w("};\n")
	w(".visible .entry %s(\n\t.param .u64 table\n)\n{", sumKernelName)
	w(`	.reg .pred p;
	.reg .b32 thr, tb, idx, acc, x, w0, w1, w2, w3, w4, w5, w6, w7, n, plen, pad, pos, ra, a, c;
	.reg .b64 gt, ga, ent, addr, base, o64, i64;
	.shared .align 16 .u32 tab[%d];
	.shared .align 16 .u32 red[%d];
	.shared .align 8 .b8 seg[16];

	mov.u32 thr, %%tid.x;
	mov.u64 gt, kv_crc_tab;
	mov.u32 tb, tab;
	// Groups 0 and 1 into shared memory, 32 bytes a thread.
	mul.wide.u32 ga, thr, 32;
	add.s64 ga, gt, ga;
	ld.global.v4.u32 {w0, w1, w2, w3}, [ga];
	ld.global.v4.u32 {w4, w5, w6, w7}, [ga+16];
	shl.b32 idx, thr, 5;
	add.u32 idx, idx, tb;
	st.shared.v4.u32 [idx], {w0, w1, w2, w3};
	st.shared.v4.u32 [idx+16], {w4, w5, w6, w7};
	// Thread 0 reads the entry (pinned host memory) for the block.
	ld.param.u64 ent, [table];
	cvta.to.global.u64 ent, ent;
	mov.u32 x, %%ctaid.y;
	mul.wide.u32 i64, x, %d;
	add.s64 ent, ent, i64;
	setp.ne.u32 p, thr, 0;
	@p bra LOADED;
	ld.global.u64 addr, [ent];
	ld.global.u32 n, [ent+8];
	st.shared.u64 [seg], addr;
	st.shared.u32 [seg+8], n;
LOADED:
	bar.sync 0;
	ld.shared.u64 addr, [seg];
	ld.shared.u32 n, [seg+8];
	cvta.to.global.u64 addr, addr;
	add.u32 plen, n, %d;
	and.b32 plen, plen, 0x%X;
	sub.u32 pad, plen, n;
	cvt.u64.u32 o64, pad;
	sub.s64 base, addr, o64;
	shl.b32 pos, thr, 4;
	mov.u32 acc, 0;
ROUND:
	setp.ge.u32 p, pos, plen;
	@p bra REDUCE;
	setp.lt.u32 p, pos, pad;
	@p bra NEXT;
	cvt.u64.u32 o64, pos;
	add.s64 o64, base, o64;
	ld.global.v4.u32 {w0, w1, w2, w3}, [o64];`, sumSharedWords, sumThreads, SumEntryBytes, sumRound-1, uint32(1<<32-sumRound))
	// acc = shift(acc, sumRound-16): group 1, shared.
	sharedLookups(w, "acc", "acc", 1)
	for _, word := range []string{"w0", "w1", "w2", "w3"} {
		w("\txor.b32 acc, acc, %s;", word)
		sharedLookups(w, "acc", "acc", 0)
	}
	w(`NEXT:
	add.u32 pos, pos, %d;
	bra ROUND;
REDUCE:
	mov.u32 ra, red;
	shl.b32 idx, thr, 2;
	add.u32 ra, ra, idx;
	st.shared.u32 [ra], acc;
	bar.sync 0;`, sumRound)
	for l := range sumLevels {
		w("\tand.b32 idx, thr, %d;\n\tsetp.ne.u32 p, idx, 0;\n\t@p bra JOINED%d;", 2<<l-1, l)
		w("\tld.shared.u32 a, [ra];\n\tld.shared.u32 c, [ra+%d];", 4<<l)
		globalLookups(w, "a", "a", 2+l)
		w("\txor.b32 a, a, c;\n\tst.shared.u32 [ra], a;\nJOINED%d:\n\tbar.sync 0;", l)
	}
	w(`	setp.ne.u32 p, thr, 0;
	@p bra DONE;
	ld.shared.u32 a, [ra];
	st.global.u32 [ent+12], a;
DONE:
	ret;
}`)
	return b.String()
}

// sharedLookups writes dst = table group g (in shared memory at tb) of
// src's four bytes, xored; src is read before dst is written.
func sharedLookups(w func(string, ...any), dst, src string, g int) {
	for k := range 4 {
		w("\tbfe.u32 idx, %s, %d, 8;\n\tmad.lo.u32 idx, idx, 4, tb;", src, 8*k)
		w("\tld.shared.u32 w%d, [idx+%d];", 4+k, 4*(g*sumGroupWords+k*256))
	}
	w("\txor.b32 w4, w4, w5;\n\txor.b32 w6, w6, w7;\n\txor.b32 %s, w4, w6;", dst)
}

// globalLookups is sharedLookups from the table in global memory (gt).
func globalLookups(w func(string, ...any), dst, src string, g int) {
	for k := range 4 {
		w("\tbfe.u32 idx, %s, %d, 8;\n\tmul.wide.u32 i64, idx, 4;\n\tadd.s64 i64, i64, gt;", src, 8*k)
		w("\tld.global.u32 w%d, [i64+%d];", 4+k, 4*(g*sumGroupWords+k*256))
	}
	w("\txor.b32 w4, w4, w5;\n\txor.b32 w6, w6, w7;\n\txor.b32 %s, w4, w6;", dst)
}

// SumKernel is the checksum kernel loaded on one device: one launch
// computes the CRC-32C registers of many spans of that device's memory,
// in place of the CPU reading their bytes in host memory.
type SumKernel struct {
	r       *Runtime
	mod, fn uintptr
}

// LoadSumKernel compiles and loads the checksum kernel on the calling
// thread's current device, as LoadCopyKernel does the copy kernel.
func (r *Runtime) LoadSumKernel() (*SumKernel, error) {
	mod, fn, err := r.loadModule(sumKernelPTX(), sumKernelName)
	if err != nil {
		return nil, err
	}
	return &SumKernel{r: r, mod: mod, fn: fn}, nil
}

// Unload unloads the kernel, on a thread with its device current, after
// every launch of it completed.
func (k *SumKernel) Unload() error { return k.r.unloadModule(&k.mod, &k.fn) }

// SumSpan is one span of device memory whose CRC-32C register a launch
// computes.
type SumSpan struct {
	Addr uintptr // device address of the span's first byte
	Len  int     // length in bytes (Summable says which spans Launch takes)
}

// Summable reports whether the kernel can checksum span: address and
// length multiples of SumAlign, the length positive and at most
// SumMaxLen.
func Summable(s SumSpan) bool {
	return s.Len > 0 && s.Len <= SumMaxLen && (s.Addr|uintptr(s.Len))%SumAlign == 0
}

// Launch writes spans into table, 8-byte aligned pinned host memory of at
// least SumEntryBytes·len(spans) bytes, and enqueues one launch on s.
// Once an event recorded after the launch has completed, SumRegister(table,
// i) is the CRC-32C register (crc32c.Register) of span i's bytes as they
// were when the launch ran: after the copies enqueued before it on s.
// Leave the table untouched until then.
func (k *SumKernel) Launch(spans []SumSpan, table []byte, s Stream) error {
	if len(spans) == 0 || len(spans) > SumMaxEntries || len(table) < len(spans)*SumEntryBytes ||
		uintptr(unsafe.Pointer(&table[0]))%8 != 0 {
		return fmt.Errorf("cuda: checksum kernel: %d spans for a %d-byte table (at most %d spans, 8-byte aligned)", len(spans), len(table), SumMaxEntries)
	}
	for i, sp := range spans {
		if !Summable(sp) {
			return fmt.Errorf("cuda: checksum kernel: span %d (%#x, %d bytes) is not %d-byte aligned or longer than %d", i, sp.Addr, sp.Len, SumAlign, SumMaxLen)
		}
		e := table[i*SumEntryBytes : (i+1)*SumEntryBytes]
		binary.LittleEndian.PutUint64(e[0:], uint64(sp.Addr))
		binary.LittleEndian.PutUint32(e[8:], uint32(sp.Len))
		binary.LittleEndian.PutUint32(e[12:], 0)
	}
	tableAddr := uintptr(unsafe.Pointer(&table[0]))
	if code := launchU64(k.r.fn.cuLaunchKernel, k.fn, 1, uint32(len(spans)), sumThreads, uintptr(s), uint64(tableAddr)); code != 0 {
		return &DriverError{Func: "cuLaunchKernel", Code: code}
	}
	return nil
}

// SumRegister returns the register the kernel wrote for entry i of table.
func SumRegister(table []byte, i int) uint32 {
	return binary.LittleEndian.Uint32(table[i*SumEntryBytes+12:])
}
