package fsys

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/kvhost/kvhost/internal/crc32c"
)

// BenchmarkMappedFirstRead measures what a load of a file nobody has read
// yet costs the CPU on a memory file system: the movers' copy out of a
// fresh mapping (MapRead) in pieces, by piece size, with and without the
// checksum that follows each piece, and by the size of the buffer copied
// into. Every iteration writes new 32 MiB files (untimed), then each of
// KVHOST_BENCH_THREADS goroutines (default GOMAXPROCS) maps its files and
// copies them piece by piece into its own buffer, wrapping around: 4 MiB,
// a staging buffer, which stays in a large last-level cache, or 32 MiB,
// a whole file, which with 16 threads does not. The ceiling is
// the same copy again through the same mappings, whose pages are then
// mapped already: the copy without the faults, in the same iteration.
//
//	KVHOST_BENCH_DIR=/dev/shm go test -run '^$' -bench MappedFirstRead ./internal/fsys
func BenchmarkMappedFirstRead(b *testing.B) {
	dir := os.Getenv("KVHOST_BENCH_DIR")
	if dir == "" {
		dir = "/dev/shm"
	}
	threads := runtime.GOMAXPROCS(0)
	if s := os.Getenv("KVHOST_BENCH_THREADS"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 {
			b.Fatalf("KVHOST_BENCH_THREADS=%q: want a positive count", s)
		}
		threads = n
	}
	const fileBytes, filesPerThread = 32 << 20, 4
	content := make([]byte, fileBytes)
	for i := range content {
		content[i] = byte(i*7 + i>>13)
	}
	cases := []struct {
		piece, buf int
		sums       bool
	}{
		{256 << 10, 4 << 20, false}, {1 << 20, 4 << 20, false}, {4 << 20, 4 << 20, false},
		{256 << 10, 4 << 20, true}, {256 << 10, 32 << 20, false}, {256 << 10, 32 << 20, true},
	}
	for _, c := range cases {
		name := fmt.Sprintf("piece=%dK/buf=%dM/sums=%t", c.piece>>10, c.buf>>20, c.sums)
		b.Run(name, func(b *testing.B) {
			root, err := os.MkdirTemp(dir, "fsys-bench-")
			if err != nil {
				b.Fatal(err)
			}
			defer os.RemoveAll(root)
			bufs := make([][]byte, threads)
			for i := range bufs {
				bufs[i] = make([]byte, c.buf)
			}
			total := int64(threads * filesPerThread * fileBytes)
			var first, again time.Duration
			for b.Loop() {
				b.StopTimer()
				paths := writeFresh(b, root, content, threads*filesPerThread)
				maps := make([]*Mapping, len(paths))
				files := make([]File, len(paths))
				for i, p := range paths {
					f, err := OS{}.OpenFile(p, os.O_RDONLY, 0)
					if err != nil {
						b.Fatal(err)
					}
					files[i] = f
				}
				b.StartTimer()
				// The first pass maps too: a job maps the file it loads.
				first += timeThreads(b, threads, func(t int) error {
					for k := range filesPerThread {
						i := t*filesPerThread + k
						m, err := files[i].(Mapper).MapRead(fileBytes)
						if err != nil {
							return err
						}
						maps[i] = m
						if err := copyPieces(m, bufs[t], c.piece, c.sums); err != nil {
							return err
						}
					}
					return nil
				})
				again += timeThreads(b, threads, func(t int) error {
					for k := range filesPerThread {
						if err := copyPieces(maps[t*filesPerThread+k], bufs[t], c.piece, c.sums); err != nil {
							return err
						}
					}
					return nil
				})
				b.StopTimer()
				for i := range maps {
					maps[i].Close()
					files[i].Close()
					os.Remove(paths[i])
				}
				b.StartTimer()
			}
			n := float64(b.N) * float64(total)
			b.ReportMetric(n/first.Seconds()/1e9, "first-GB/s")
			b.ReportMetric(n/again.Seconds()/1e9, "ceiling-GB/s")
			b.ReportMetric(again.Seconds()/first.Seconds(), "first/ceiling")
			b.ReportMetric(0, "ns/op")
		})
	}
}

// writeFresh writes n files of content under root and returns their paths.
func writeFresh(b *testing.B, root string, content []byte, n int) []string {
	b.Helper()
	paths := make([]string, n)
	for i := range paths {
		paths[i] = filepath.Join(root, fmt.Sprintf("f%d", i))
		if err := os.WriteFile(paths[i], content, 0o600); err != nil {
			b.Fatal(err)
		}
	}
	return paths
}

// timeThreads runs fn for threads goroutines at once and returns the
// wall time from their start to the last one's end.
func timeThreads(b *testing.B, threads int, fn func(t int) error) time.Duration {
	b.Helper()
	var wg sync.WaitGroup
	errs := make([]error, threads)
	start := time.Now()
	for t := range threads {
		wg.Go(func() { errs[t] = fn(t) })
	}
	wg.Wait()
	d := time.Since(start)
	for _, err := range errs {
		if err != nil {
			b.Fatal(err)
		}
	}
	return d
}

// copyPieces copies all of m into buf, piece bytes at a time (buf
// wrapping around), checksumming each piece after its copy if sums.
func copyPieces(m *Mapping, buf []byte, piece int, sums bool) error {
	var crc uint32
	for off := int64(0); off < m.Len(); off += int64(piece) {
		at := int(off % int64(len(buf)))
		p := buf[at : at+piece]
		n, err := m.ReadAt(p, off)
		if err != nil {
			return err
		}
		if sums {
			crc = crc32c.Update(crc, p[:n])
		}
	}
	return nil
}
