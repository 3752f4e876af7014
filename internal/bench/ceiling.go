package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// Align is the alignment of O_DIRECT offsets, lengths and buffers.
const Align = 4096

// ErrShort means a file was shorter than the ceiling pass expected.
var ErrShort = errors.New("bench: short file")

// RoundUp rounds n up to a multiple of Align.
func RoundUp(n int64) int64 { return (n + Align - 1) &^ (Align - 1) }

// ReadFiles reads every file whole, one pread per file, with len(bufs)
// threads, each reading into its own buffer: the read ceiling of the
// same files with the same threads. Each buffer must hold the largest file
// rounded up to Align (and be aligned when direct). It returns the bytes
// read and the wall time.
func ReadFiles(ctx context.Context, paths []string, bufs [][]byte, direct bool) (int64, time.Duration, error) {
	flags := os.O_RDONLY
	if direct {
		flags |= unix.O_DIRECT
	}
	var total atomic.Int64
	d, err := parallel(ctx, len(paths), len(bufs), func(t, i int) error {
		f, err := os.OpenFile(paths[i], flags, 0)
		if err != nil {
			return fmt.Errorf("bench: ceiling read: %w", err)
		}
		defer f.Close()
		fi, err := f.Stat()
		if err != nil {
			return fmt.Errorf("bench: ceiling read: %w", err)
		}
		size := fi.Size()
		want := size
		if direct {
			want = RoundUp(size)
		}
		if int64(len(bufs[t])) < want {
			return fmt.Errorf("bench: ceiling read %s: %d-byte file, %d-byte buffer", paths[i], size, len(bufs[t]))
		}
		n, err := readFull(f, bufs[t][:want])
		if err != nil {
			return fmt.Errorf("bench: ceiling read %s: %w", paths[i], err)
		}
		if n < size {
			return fmt.Errorf("bench: ceiling read %s: %w: %d of %d bytes", paths[i], ErrShort, n, size)
		}
		total.Add(size)
		return nil
	})
	return total.Load(), d, err
}

// readFull preads b from offset 0 until it is full or the file ends.
func readFull(f *os.File, b []byte) (int64, error) { return readAt(f, b, 0) }

// readAt preads b from offset off until it is full or the file ends.
func readAt(f *os.File, b []byte, off int64) (int64, error) {
	var n int64
	for n < int64(len(b)) {
		k, err := f.ReadAt(b[n:], off+n)
		n += int64(k)
		if err == io.EOF || (err == nil && k == 0) {
			break
		}
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

// WriteFiles creates (or truncates) paths[i] and writes sizes[i] bytes
// from the thread's buffer, one pwrite per file, with len(bufs) threads;
// with fsync each file is synced before it counts, as a durable store is.
// Direct writes round each size up to Align. It returns the bytes written
// and the wall time.
func WriteFiles(ctx context.Context, paths []string, sizes []int64, bufs [][]byte, direct, fsync bool) (int64, time.Duration, error) {
	return writeFiles(ctx, paths, sizes, bufs, direct, fsync, os.O_CREATE|os.O_TRUNC)
}

// OverwriteFiles is WriteFiles into files that exist, without truncating
// them: on a memory file system their pages are not allocated again (the
// write ceiling of a full cache, whose stores write into evicted files).
func OverwriteFiles(ctx context.Context, paths []string, sizes []int64, bufs [][]byte, direct, fsync bool) (int64, time.Duration, error) {
	return writeFiles(ctx, paths, sizes, bufs, direct, fsync, 0)
}

// WriteIntoFiles is WriteFiles that truncates nothing: paths that exist
// are written in place, as OverwriteFiles writes them, and the others are
// created (the write ceiling of stores of which some took spare files and
// the rest wrote fresh ones).
func WriteIntoFiles(ctx context.Context, paths []string, sizes []int64, bufs [][]byte, direct, fsync bool) (int64, time.Duration, error) {
	return writeFiles(ctx, paths, sizes, bufs, direct, fsync, os.O_CREATE)
}

func writeFiles(ctx context.Context, paths []string, sizes []int64, bufs [][]byte, direct, fsync bool, create int) (int64, time.Duration, error) {
	flags := os.O_WRONLY | create
	if direct {
		flags |= unix.O_DIRECT
	}
	var total atomic.Int64
	d, err := parallel(ctx, len(paths), len(bufs), func(t, i int) error {
		n := sizes[i]
		if direct {
			n = RoundUp(n)
		}
		if int64(len(bufs[t])) < n {
			return fmt.Errorf("bench: ceiling write %s: %d bytes, %d-byte buffer", paths[i], n, len(bufs[t]))
		}
		f, err := os.OpenFile(paths[i], flags, 0o600)
		if err != nil {
			return fmt.Errorf("bench: ceiling write: %w", err)
		}
		var off int64
		for off < n && err == nil {
			var k int
			k, err = f.WriteAt(bufs[t][off:n], off)
			off += int64(k)
		}
		if err == nil && fsync {
			err = f.Sync()
		}
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return fmt.Errorf("bench: ceiling write %s: %w", paths[i], err)
		}
		total.Add(n)
		return nil
	})
	return total.Load(), d, err
}

// parallel runs fn(thread, item) over n items on threads goroutines, items
// handed out in order, and times the whole. The first error stops the
// handing out and is returned.
func parallel(ctx context.Context, n, threads int, fn func(t, i int) error) (time.Duration, error) {
	var next atomic.Int64
	var wg sync.WaitGroup
	var once sync.Once
	var first error
	fail := func(err error) { once.Do(func() { first = err }) }
	var failed atomic.Bool
	start := time.Now()
	for t := range max(1, threads) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for !failed.Load() {
				i := int(next.Add(1) - 1)
				if i >= n {
					return
				}
				if err := ctx.Err(); err != nil {
					fail(err)
					failed.Store(true)
					return
				}
				if err := fn(t, i); err != nil {
					fail(err)
					failed.Store(true)
					return
				}
			}
		}()
	}
	wg.Wait()
	return time.Since(start), first
}

// CPUTime is the calling process's CPU time so far, user and system, of
// every thread.
func CPUTime() time.Duration {
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// CPUMsPerGB is CPU time d per bytes, in milliseconds per GB (1e9 bytes).
func CPUMsPerGB(d time.Duration, bytes int64) float64 {
	if bytes <= 0 {
		return 0
	}
	return d.Seconds() * 1e3 / (float64(bytes) / 1e9)
}

// DropCaches makes the next reads of paths cold: each file's dirty pages
// are written back and its cached pages dropped (posix_fadvise
// POSIX_FADV_DONTNEED), then, when the process may, the whole page cache
// (/proc/sys/vm/drop_caches). It reports whether the global drop worked.
// On tmpfs nothing is dropped: the page cache is the file.
func DropCaches(paths []string) (global bool, err error) {
	for _, p := range paths {
		f, err := os.Open(p)
		if err != nil {
			return false, fmt.Errorf("bench: drop caches: %w", err)
		}
		// fdatasync first: DONTNEED skips dirty pages.
		_ = unix.Fdatasync(int(f.Fd()))
		err = unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED)
		f.Close()
		if err != nil {
			return false, fmt.Errorf("bench: drop caches: fadvise %s: %w", p, err)
		}
	}
	unix.Sync()
	return os.WriteFile("/proc/sys/vm/drop_caches", []byte("3\n"), 0o200) == nil, nil
}

// AlignedBuffer returns n bytes (rounded up to Align) aligned to Align,
// from an anonymous mapping, for O_DIRECT ceilings without a GPU.
func AlignedBuffer(n int64) ([]byte, error) {
	b, err := unix.Mmap(-1, 0, int(RoundUp(max(n, Align))), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return nil, fmt.Errorf("bench: buffer of %d bytes: %w", n, err)
	}
	return b, nil
}

// FreeBuffer releases a buffer from AlignedBuffer.
func FreeBuffer(b []byte) error { return unix.Munmap(b) }
