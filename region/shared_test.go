//go:build linux

package region

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/internal/crc32c"
	"github.com/kvhost/kvhost/internal/fstype"
)

// shmFile creates a file of size bytes under /dev/shm, as vLLM creates its
// shared CPU region, and returns an fd of it (owned by the caller) and a
// second fd the "client" keeps to truncate it.
func shmFile(t *testing.T, size int64) (daemonFd int, client *os.File) {
	t.Helper()
	if st, err := os.Stat("/dev/shm"); err != nil || !st.IsDir() {
		t.Skip("no /dev/shm on this machine")
	}
	f, err := os.CreateTemp("/dev/shm", "kvhost-region-test-*.mmap")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(f.Name()); f.Close() })
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	fd, err := unix.Open(f.Name(), unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	return fd, f
}

func TestOpenSharedAcceptsMemoryFilesOnly(t *testing.T) {
	const size = 1 << 16
	unsealed, err := unix.MemfdCreate("unsealed", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	unix.Ftruncate(unsealed, size)
	sealed, err := unix.MemfdCreate("sealed", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		t.Fatal(err)
	}
	unix.Ftruncate(sealed, size)
	if _, err := unix.FcntlInt(uintptr(sealed), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK); err != nil {
		t.Fatal(err)
	}
	shm, _ := shmFile(t, size)
	disk, err := os.CreateTemp(t.TempDir(), "disk")
	if err != nil {
		t.Fatal(err)
	}
	defer disk.Close()
	disk.Truncate(size)
	var fs unix.Statfs_t
	onDisk := unix.Fstatfs(int(disk.Fd()), &fs) == nil && fs.Type != fstype.Tmpfs
	diskFd, _ := unix.Dup(int(disk.Fd()))
	dir, err := unix.Open(filepath.Dir(disk.Name()), unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name       string
		fd         int
		size       int64
		want       error
		shrinkable bool
	}{
		{"unsealed memfd", unsealed, size, nil, true},
		{"sealed memfd", sealed, size, nil, false},
		{"dev shm file", shm, size, nil, true},
		{"larger than the file", shm, size + 1, ErrBounds, false},
		{"directory", dir, size, ErrNotShared, false},
		{"file on disk", diskFd, size, ErrNotShared, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if tc.fd == diskFd && !onDisk {
				t.Skip("the test's temporary directory is on tmpfs: no disk file to refuse")
			}
			fd, err := unix.Dup(tc.fd)
			if err != nil {
				t.Fatal(err)
			}
			h, err := OpenShared(fd, tc.size)
			if tc.want != nil {
				unix.Close(fd)
				if !errors.Is(err, tc.want) {
					t.Fatalf("err = %v, want %v", err, tc.want)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			defer h.Close()
			if h.Shrinkable() != tc.shrinkable || h.Len() != tc.size {
				t.Fatalf("shrinkable %v len %d, want %v %d", h.Shrinkable(), h.Len(), tc.shrinkable, tc.size)
			}
			if err := h.CheckSize(); err != nil {
				t.Fatalf("CheckSize of a whole file: %v", err)
			}
		})
	}
	for _, fd := range []int{unsealed, sealed, shm, diskFd, dir} {
		unix.Close(fd)
	}
}

// TestGuardTurnsTruncationFaultIntoError truncates a /dev/shm file under
// a daemon-side mapping, as a client may, and checks that copies and
// checksums over the missing pages, in both directions and on goroutines
// other than the test's, fail with ErrFault instead of killing the
// process, and that the memory still there stays usable.
func TestGuardTurnsTruncationFaultIntoError(t *testing.T) {
	const size = 1 << 20
	fd, client := shmFile(t, size)
	h, err := OpenShared(fd, size)
	if err != nil {
		unix.Close(fd)
		t.Fatal(err)
	}
	defer h.Close()
	mem := h.Bytes()
	for i := range mem {
		mem[i] = byte(i)
	}
	if err := client.Truncate(size / 2); err != nil {
		t.Fatal(err)
	}
	if err := h.CheckSize(); !errors.Is(err, ErrTruncated) {
		t.Fatalf("CheckSize after truncation: %v, want ErrTruncated", err)
	}
	buf := make([]byte, size)
	tests := []struct {
		name string
		fn   func() error
		want error
	}{
		{"copy out of the missing half", func() error { _, err := SafeCopy(buf, mem); return err }, ErrFault},
		{"copy into the missing half", func() error { _, err := SafeCopy(mem[size/2:], buf); return err }, ErrFault},
		{"checksum over the missing half", func() error {
			return Guard(func() error { crc32c.Checksum(mem); return nil })
		}, ErrFault},
		{"copy of the half still there", func() error {
			n, err := SafeCopy(buf, mem[:size/2])
			if err == nil && (n != size/2 || buf[size/2-1] != byte((size/2-1)%256)) {
				return errors.New("wrong bytes copied")
			}
			return err
		}, nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			done := make(chan error, 1)
			go func() { done <- tc.fn() }()
			if err := <-done; !errors.Is(err, tc.want) && (tc.want != nil || err != nil) {
				t.Fatalf("err = %v, want %v", err, tc.want)
			}
		})
	}
}

func TestGuardPropagatesOtherPanics(t *testing.T) {
	tests := []struct {
		name string
		fn   func() error
	}{
		{"nil dereference", func() error {
			var p *int
			return errors.New(string(rune(*p)))
		}},
		{"explicit panic", func() error { panic("boom") }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			defer func() {
				if recover() == nil {
					t.Fatal("the panic did not propagate")
				}
			}()
			Guard(tc.fn)
		})
	}
}

func TestGuardRestoresPanicOnFault(t *testing.T) {
	if err := Guard(func() error { return nil }); err != nil {
		t.Fatal(err)
	}
	want := errors.New("fn's error")
	if err := Guard(func() error { return want }); err != want {
		t.Fatalf("err = %v, want fn's own error", err)
	}
	// Guard set nothing that outlives it: the setting it found is back.
	if old := debugSetPanicOnFault(false); old {
		t.Fatal("SetPanicOnFault still on after Guard")
	}
}
