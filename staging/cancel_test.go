package staging

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"

	"github.com/kvhost/kvhost/fsys"
	"github.com/kvhost/kvhost/region"
)

// TestBouncedRunsStopWhenTheContextIsCancelled: a direct write or read of
// memory that is not aligned goes through the bounce buffers; a context
// cancelled during its first chunk's I/O fails the call with the
// context's error, and no later chunk reaches the file. The runs here are
// 64 chunks of one 4 KiB buffer each.
func TestBouncedRunsStopWhenTheContextIsCancelled(t *testing.T) {
	const chunks = 64
	for _, tc := range []struct {
		name  string
		write bool
	}{
		{"write", true},
		{"read", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, err := newPool(Config{Workers: 1, BufferSize: Align, Buffers: 4})
			if err != nil {
				t.Fatal(err)
			}
			defer p.close()
			name := filepath.Join(t.TempDir(), "f")
			want := bytes.Repeat([]byte("kvhost!!"), chunks*Align/8)
			if err := os.WriteFile(name, want, 0o600); err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			op := fsys.OpRead
			if tc.write {
				op = fsys.OpWrite
			}
			var calls atomic.Int32
			fs := &fsys.Faulty{FS: fsys.OS{}, Inj: fsys.InjectorFunc(func(o fsys.Op, _ string) fsys.Fault {
				if o == op && calls.Add(1) == 1 {
					cancel() // during the first chunk's I/O
				}
				return fsys.Fault{}
			})}
			// The file is opened without O_DIRECT so that any file system
			// serves; options.Direct alone sends unaligned memory through
			// the bounce buffers.
			f, err := fs.OpenFile(name, os.O_RDWR, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			mem := fsys.AlignedBuffer(chunks*Align + 1)
			spans := []span{{Off: 0, Buf: mem[1:], Sum: 0}} // not aligned: bounced
			done := make(chan error, 1)
			if err := p.submit(context.Background(), func(w *worker) {
				var err error
				if tc.write {
					_, err = w.write(ctx, f, spans, options{Direct: true, Sums: make([]uint32, 1)})
				} else {
					_, err = w.read(ctx, f, spans, options{Direct: true, Sums: make([]uint32, 1)})
				}
				done <- err
			}); err != nil {
				t.Fatal(err)
			}
			err = <-done
			if n := calls.Load(); !errors.Is(err, context.Canceled) || n != 1 {
				t.Fatalf("%s of %d chunks cancelled during the first: %v after %d chunks' I/O; want context.Canceled after 1",
					tc.name, chunks, err, n)
			}
		})
	}
}

// TestBouncedReadStopsReadingOnceItsScatterFaults: a direct read of
// memory that is not aligned goes through the bounce buffers, the worker
// reading a chunk while a helper copies the one before into the run's
// memory. When that copy faults (the client truncated the shared file
// behind its region), the call fails with region.ErrFault and the worker
// reads no more than the chunks it had read ahead of the copy (the
// faulting chunk, the one queued behind it and the one in hand), not the
// rest of the run. The run here is 64 chunks of one 4 KiB buffer each.
func TestBouncedReadStopsReadingOnceItsScatterFaults(t *testing.T) {
	const chunks = 64
	p, err := newPool(Config{Workers: 1, BufferSize: Align, Buffers: 4})
	if err != nil {
		t.Fatal(err)
	}
	defer p.close()
	const size = 2 * (chunks + 1) * Align
	shm, r := sharedRegion(t, size)
	if err := shm.Truncate(size / 2); err != nil { // the run's memory goes away
		t.Fatal(err)
	}
	name := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(name, make([]byte, chunks*Align), 0o600); err != nil {
		t.Fatal(err)
	}
	var reads atomic.Int32
	fs := &fsys.Faulty{FS: fsys.OS{}, Inj: fsys.InjectorFunc(func(o fsys.Op, _ string) fsys.Fault {
		if o == fsys.OpRead {
			reads.Add(1)
		}
		return fsys.Fault{}
	})}
	f, err := fs.OpenFile(name, os.O_RDONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	mem := r.Bytes()[size/2+1 : size/2+1+chunks*Align] // not aligned: bounced
	spans := []span{{Off: 0, Buf: mem, Sum: 0}}
	done := make(chan error, 1)
	if err := p.submit(context.Background(), func(w *worker) {
		_, err := w.read(context.Background(), f, spans, options{Direct: true, Sums: make([]uint32, 1)})
		done <- err
	}); err != nil {
		t.Fatal(err)
	}
	err = <-done
	if n := reads.Load(); !errors.Is(err, region.ErrFault) || n > 3 {
		t.Fatalf("read of %d chunks whose first copy faults: %v after %d chunks read; want region.ErrFault after at most 3", chunks, err, n)
	}
}
