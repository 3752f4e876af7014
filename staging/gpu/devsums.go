package gpu

import (
	"math/bits"

	"github.com/kvhost/kvhost/cuda"
	"github.com/kvhost/kvhost/internal/crc32c"
)

// Checksums on the device (Config.SumsOnDevice). A job's spans, each
// piece of its chunks that feeds a checksum cut into spans of at most
// cuda.SumMaxLen bytes, are checksummed by one launch of the checksum
// kernel on the job's stream: after every copy of a load, before the
// first copy of a store. The kernel writes each span's CRC register into
// the lane's table; once an event after the launch has completed, the
// job joins the registers into its checksum slots in file order
// (crc32c.Extender), which is what the CPU's Update would have computed
// from the same bytes.

// minSumTable is the smallest table a lane allocates (4096 spans).
const minSumTable = 4096 * cuda.SumEntryBytes

// devSums is a lane's checksum table and the spans of its last launch.
type devSums struct {
	table *cuda.Pinned
	spans []cuda.SumSpan
	slots []int // the checksum slot of each span
}

// sumsOnDevice prepares ln for the job's checksums on dev: its spans and
// a table that holds them. It reports false, and the CPU checksums the
// job, where dev has no checksum kernel, where the kernel cannot take
// every span, or where no table could be allocated.
func (m *Mover) sumsOnDevice(dev *device, ln *lane, chunks []chunk) bool {
	if dev.sum == nil {
		return false
	}
	d := &ln.sums
	d.spans, d.slots = d.spans[:0], d.slots[:0]
	for i := range chunks {
		for _, p := range chunks[i].pieces {
			if p.sum < 0 {
				continue
			}
			for off := 0; off < p.n; off += cuda.SumMaxLen {
				sp := cuda.SumSpan{Addr: p.dev + uintptr(off), Len: min(p.n-off, cuda.SumMaxLen)}
				if !cuda.Summable(sp) {
					return false
				}
				d.spans = append(d.spans, sp)
				d.slots = append(d.slots, p.sum)
			}
		}
	}
	if len(d.spans) == 0 || len(d.spans) > cuda.SumMaxEntries {
		return false
	}
	need := len(d.spans) * cuda.SumEntryBytes
	if d.table != nil && len(d.table.Bytes()) >= need {
		return true
	}
	if d.table != nil {
		d.table.Free()
		d.table = nil
	}
	t, err := m.r.HostAlloc(max(minSumTable, 1<<bits.Len(uint(need-1))))
	if err != nil {
		return false
	}
	d.table = t
	return true
}

// sumsWhere decides where a job's checksums are computed: by the
// checksum kernel on dev (onDevice; the CPU then fills no slot, cpuSums
// nil) where sumsOnDevice takes the job, else by the CPU (cpuSums is
// sums).
func (m *Mover) sumsWhere(dev *device, ln *lane, chunks []chunk, sums []uint32) (cpuSums []uint32, onDevice bool) {
	if sums != nil && m.sumsOnDevice(dev, ln, chunks) {
		return nil, true
	}
	return sums, false
}

// launch enqueues the checksum kernel over ln's spans on its stream.
func (d *devSums) launch(dev *device, ln *lane) error {
	return dev.sum.Launch(d.spans, d.table.Bytes(), ln.stream)
}

// fold joins the registers of the last launch into sums, in file order;
// an event recorded after the launch must have completed.
func (d *devSums) fold(sums []uint32) {
	t := d.table.Bytes()
	var ext crc32c.Extender // spans are mostly of one length: x^(8n) once per run of them
	for i, sp := range d.spans {
		if n := int64(sp.Len); n != ext.Len() {
			ext = crc32c.NewExtender(n)
		}
		s := d.slots[i]
		sums[s] = ext.Extend(sums[s], cuda.SumRegister(t, i))
	}
}

// free frees the table (the lane is being destroyed).
func (d *devSums) free() {
	if d.table != nil {
		d.table.Free()
		d.table = nil
	}
}
