package bench

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// A Stager copies one ceiling thread's chunks between its pinned buffer
// and the GPU, on a stream of its own: the device half of a staged
// ceiling (StagedRead, StagedWrite). Each thread has its own Stager, and
// a thread's slots are its two halves of a double buffer.
type Stager interface {
	// Do runs fn on the thread that Start and Wait must be called from
	// (a CUDA worker's thread, whose device is current) and returns its
	// error.
	Do(ctx context.Context, fn func() error) error
	// Start enqueues the copy of p, the thread's slot s (0 or 1), to the
	// GPU (toDevice) or from the GPU into p, and returns without waiting.
	Start(s int, p []byte, toDevice bool) error
	// Wait blocks until slot s's last copy is done (at once if none was
	// started).
	Wait(s int) error
}

// errStagedBuffer: a thread's buffer cannot hold its two slots.
var errStagedBuffer = errors.New("bench: staged ceiling: buffer smaller than two chunks")

// StagedRead reads every file the way a pipeline through pinned buffers
// moves a load: each thread reads a file chunk by chunk into one half of
// its buffer (bufs[t], two chunks of chunk bytes) and copies that chunk to
// the GPU (stagers[t]) while it reads the next into the other half; a
// file counts once its last copy is done. A chunk is read in system calls
// of piece bytes (a multiple of Align; 0: one per chunk). It is a load
// through pinned host memory done plainly: the file's bytes are copied by
// the CPU into memory the GPU then reads, so the read and the copy share
// the host's memory. It returns the bytes read and the wall time; when it
// returns, no copy it started is still running, whatever failed.
func StagedRead(ctx context.Context, paths []string, bufs [][]byte, chunk, piece int64, stagers []Stager, direct bool) (int64, time.Duration, error) {
	if err := checkStaged(bufs, chunk, stagers); err != nil {
		return 0, 0, err
	}
	if piece < 0 || piece%Align != 0 {
		return 0, 0, fmt.Errorf("bench: staged read: pieces of %d bytes, want a multiple of %d", piece, Align)
	}
	if piece == 0 || piece > chunk {
		piece = chunk
	}
	flags := os.O_RDONLY
	if direct {
		flags |= unix.O_DIRECT
	}
	var total atomic.Int64
	d, err := parallel(ctx, len(paths), len(bufs), func(t, i int) error {
		st := stagers[t]
		err := st.Do(ctx, func() (err error) {
			// Every copy has finished before the buffer is reused or
			// handed back, whatever failed.
			defer func() {
				if derr := drain(st); err == nil {
					err = derr
				}
			}()
			f, err := os.OpenFile(paths[i], flags, 0)
			if err != nil {
				return err
			}
			defer f.Close()
			fi, err := f.Stat()
			if err != nil {
				return err
			}
			size := fi.Size()
			for k, off := 0, int64(0); off < size; k, off = k+1, off+chunk {
				s := k % 2
				if err := st.Wait(s); err != nil { // the slot's last copy has left it
					return err
				}
				n := min(chunk, size-off)
				want := n
				if direct {
					want = RoundUp(n)
				}
				slot := bufs[t][int64(s)*chunk : int64(s)*chunk+want]
				var got int64
				for lo := int64(0); lo < want && got == lo; lo += piece {
					m, err := readAt(f, slot[lo:min(want, lo+piece)], off+lo)
					if err != nil {
						return err
					}
					got += m
				}
				if got < n {
					return fmt.Errorf("%w: %d of %d bytes at %d", ErrShort, got, n, off)
				}
				if err := st.Start(s, slot[:n], true); err != nil {
					return err
				}
			}
			if err := drain(st); err != nil { // the file counts once its copies are done
				return err
			}
			total.Add(size)
			return nil
		})
		if err != nil {
			return fmt.Errorf("bench: staged read %s: %w", paths[i], err)
		}
		return nil
	})
	return total.Load(), d, err
}

// StagedWrite writes sizes[i] bytes to paths[i] the way a pipeline
// through pinned buffers moves a store: each thread copies a chunk from
// the GPU into one half of its buffer (stagers[t]) and writes it to the
// file while the GPU copies the next into the other half; with fsync the
// file is synced before it counts. With overwrite no file is truncated:
// those that exist are written in place (writes into spare files) and the
// others created; else they are created or truncated. Direct writes round each size up to Align. It returns the
// bytes written and the wall time; when it returns, no copy it started
// is still running, whatever failed.
func StagedWrite(ctx context.Context, paths []string, sizes []int64, bufs [][]byte, chunk int64, stagers []Stager, direct, fsync, overwrite bool) (int64, time.Duration, error) {
	if err := checkStaged(bufs, chunk, stagers); err != nil {
		return 0, 0, err
	}
	if len(sizes) != len(paths) {
		return 0, 0, fmt.Errorf("bench: staged write: %d sizes for %d files", len(sizes), len(paths))
	}
	flags := os.O_WRONLY | os.O_CREATE
	if !overwrite {
		flags |= os.O_TRUNC
	}
	if direct {
		flags |= unix.O_DIRECT
	}
	var total atomic.Int64
	d, err := parallel(ctx, len(paths), len(bufs), func(t, i int) error {
		st := stagers[t]
		size := sizes[i]
		if direct {
			size = RoundUp(size)
		}
		slot := func(k int) []byte {
			off := int64(k) * chunk
			s := int64(k % 2)
			return bufs[t][s*chunk : s*chunk+min(chunk, size-off)]
		}
		chunks := int((size + chunk - 1) / chunk)
		err := st.Do(ctx, func() (err error) {
			f, err := os.OpenFile(paths[i], flags, 0o600)
			if err != nil {
				return err
			}
			defer func() {
				// Every copy has finished before the buffer is reused,
				// whatever failed.
				if derr := drain(st); err == nil {
					err = derr
				}
				if cerr := f.Close(); err == nil {
					err = cerr
				}
			}()
			if chunks > 0 {
				if err := st.Start(0, slot(0), false); err != nil {
					return err
				}
			}
			for k := range chunks {
				if k+1 < chunks { // the next chunk's slot was written out last turn
					if err := st.Start((k+1)%2, slot(k+1), false); err != nil {
						return err
					}
				}
				if err := st.Wait(k % 2); err != nil {
					return err
				}
				if err := writeAt(f, slot(k), int64(k)*chunk); err != nil {
					return err
				}
			}
			if fsync {
				return f.Sync()
			}
			return nil
		})
		if err != nil {
			return fmt.Errorf("bench: staged write %s: %w", paths[i], err)
		}
		total.Add(size)
		return nil
	})
	return total.Load(), d, err
}

// drain waits for the copies of both of st's slots and returns the first
// error.
func drain(st Stager) error {
	err0 := st.Wait(0)
	if err1 := st.Wait(1); err0 == nil {
		return err1
	}
	return err0
}

// checkStaged says what is wrong with a staged ceiling's arguments.
func checkStaged(bufs [][]byte, chunk int64, stagers []Stager) error {
	if chunk <= 0 || chunk%Align != 0 {
		return fmt.Errorf("bench: staged ceiling: chunk of %d bytes, want a positive multiple of %d", chunk, Align)
	}
	if len(stagers) != len(bufs) {
		return fmt.Errorf("bench: staged ceiling: %d stagers for %d threads", len(stagers), len(bufs))
	}
	for t, b := range bufs {
		if int64(len(b)) < 2*chunk {
			return fmt.Errorf("%w: thread %d has %d bytes, chunks are %d", errStagedBuffer, t, len(b), chunk)
		}
	}
	return nil
}

// writeAt pwrites all of b at off.
func writeAt(f *os.File, b []byte, off int64) error {
	for len(b) > 0 {
		k, err := f.WriteAt(b, off)
		if err != nil {
			return err
		}
		b, off = b[k:], off+int64(k)
	}
	return nil
}
