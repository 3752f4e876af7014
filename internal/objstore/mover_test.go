package objstore_test

import (
	"context"
	"errors"
	"os"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/internal/crc32c"
	"github.com/kvhost/kvhost/internal/objstore"
	"github.com/kvhost/kvhost/internal/objstore/objstoretest"
	"github.com/kvhost/kvhost/region"
	"github.com/kvhost/kvhost/transfer"
)

// TestTheMoversChecksumsAreThoseOfItsExtentsInPlanOrder: the mover,
// which checksums each extent where its last range lands and joins them
// after, reads a plan of extents of uneven lengths, across range
// boundaries, with gaps (several runs), two checksum slots taken in
// turn and one extent with none, into their memory, and returns for
// each slot the CRC-32C of its extents' bytes in plan order, after a
// header read at 0 (the head from memory) and without one.
func TestTheMoversChecksumsAreThoseOfItsExtentsInPlanOrder(t *testing.T) {
	const rs = 1 << 20
	ctx := context.Background()
	st := rangedStore(t, rs)
	key := []byte("mover")
	obj := putRandom(t, st, key, 3*rs+rs/3)
	mem, err := region.NewHost("mover", int64(len(obj)))
	if err != nil {
		t.Fatal(err)
	}
	defer mem.Close()
	// Extents: from 4096, lengths in KiB, a gap of 8 KiB before the
	// fourth and the sixth, slots 0, 1, 0, 1, -1, 0, ...
	var plan transfer.Plan
	plan.Sums = 2
	at, memAt := int64(4096), int64(0)
	for i, kib := range []int64{300, 700, 1000, 5, 333, 900, 17} {
		if i == 3 || i == 5 {
			at += 8 << 10
		}
		sum := i % 2
		if i == 4 {
			sum = -1
		}
		plan.Extents = append(plan.Extents, transfer.Extent{FileOff: at, Region: mem, RegionOff: memAt, Len: kib << 10, Sum: sum})
		at, memAt = at+kib<<10, memAt+kib<<10
	}
	want := make([]uint32, plan.Sums)
	for _, x := range plan.Extents {
		if x.Sum >= 0 {
			want[x.Sum] = crc32c.Update(want[x.Sum], obj[x.FileOff:x.FileOff+x.Len])
		}
	}
	for _, header := range []bool{true, false} {
		clear(mem.Bytes())
		f, err := st.Open(ctx, 1, key)
		if err != nil {
			t.Fatal(err)
		}
		if header {
			if _, err := f.ReadAt(make([]byte, 4096), 0); err != nil {
				t.Fatal(err)
			}
		}
		sums := make([]uint32, plan.Sums)
		n, err := st.Mover().ReadFile(ctx, f, &plan, sums)
		f.Close()
		if err != nil || n != plan.Bytes() {
			t.Fatalf("header read first %v: %d of %d bytes: %v", header, n, plan.Bytes(), err)
		}
		for i, s := range sums {
			if s != want[i] {
				t.Errorf("header read first %v: slot %d: checksum %08x, want %08x", header, i, s, want[i])
			}
		}
		for i, x := range plan.Extents {
			if string(mem.Bytes()[x.RegionOff:x.RegionOff+x.Len]) != string(obj[x.FileOff:x.FileOff+x.Len]) {
				t.Errorf("header read first %v: extent %d: other bytes", header, i)
			}
		}
	}
}

// TestAClientThatTruncatesItsMemoryFailsTheLoadNotTheDaemon: loads into
// a client's shared memory that the client truncated past the object's
// head, where the ranges read on goroutines of their own land, fail
// with an error, and the process goes on (a fault there not guarded
// killed it: 3 runs of 3).
func TestAClientThatTruncatesItsMemoryFailsTheLoadNotTheDaemon(t *testing.T) {
	const rs = 1 << 20
	ctx := context.Background()
	st := rangedStore(t, rs)
	key := []byte("truncated")
	putRandom(t, st, key, 4*rs)
	shm, err := os.CreateTemp("/dev/shm", "kvhost-objstore-test-*")
	if err != nil {
		t.Skipf("no /dev/shm: %v", err)
	}
	defer os.Remove(shm.Name())
	defer shm.Close()
	if err := shm.Truncate(4 * rs); err != nil {
		t.Fatal(err)
	}
	fd, err := unix.Open(shm.Name(), unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	mem, err := region.OpenShared(fd, 4*rs)
	if err != nil {
		unix.Close(fd)
		t.Fatal(err)
	}
	defer mem.Close()
	if err := shm.Truncate(rs + rs/2); err != nil { // past the head, in a range
		t.Fatal(err)
	}
	plan := transfer.Plan{Sums: 1, Extents: []transfer.Extent{{FileOff: 4096, Region: mem, Len: 4*rs - 8192, Sum: 0}}}
	// Each time, a GET's bytes meet the missing pages in the kernel (a
	// read that fails, EFAULT) or in a copy of the process (a fault):
	// several loads, so that a copy meets them too.
	for range 8 {
		f, err := st.Open(ctx, 1, key)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := f.ReadAt(make([]byte, 4096), 0); err != nil {
			t.Fatal(err)
		}
		_, err = st.Mover().ReadFile(ctx, f, &plan, make([]uint32, 1))
		f.Close()
		if !errors.Is(err, region.ErrFault) && !errors.Is(err, syscall.EFAULT) {
			t.Fatalf("a load into truncated memory: %v, want a fault (region.ErrFault) or EFAULT", err)
		}
	}
}

// rangedStore opens a store on a fresh bucket, of RangeSize rs, closed
// when the test ends.
func rangedStore(t *testing.T, rs int64) *objstore.Store {
	t.Helper()
	cfg := rgwConfig(t)
	cfg.RangeSize = rs
	st, err := objstore.Open(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	return st
}

// putRandom writes size random bytes, seeded by size, as key's object
// of namespace 1, behind st's back, and returns them.
func putRandom(t *testing.T, st *objstore.Store, key []byte, size int64) []byte {
	t.Helper()
	b := make([]byte, size)
	objstoretest.Fill(b, uint64(size))
	if err := objstore.RawClient(st).Put(context.Background(), st.Name(1, key), b); err != nil {
		t.Fatal(err)
	}
	return b
}
