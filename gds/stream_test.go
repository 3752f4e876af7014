//go:build linux && cgo

package gds

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"
)

// TestStreamAPIMovesBytesAndReportsErrorsThroughTheRealBinding drives the
// stream binding (cuFileStreamRegister, cuFileWriteAsync, cuFileReadAsync)
// through dlopen of the fake library: the byte counts come back through the
// C memory the library writes, a failed I/O reads as its Status (or as the
// errno a small negative count stands for), a refused
// enqueue fails at once, and a library without the API says so.
func TestStreamAPIMovesBytesAndReportsErrorsThroughTheRealBinding(t *testing.T) {
	e := openFake(t, Config{}, nil)
	if !e.d.api.hasStream() {
		t.Fatal("the fake library exports the stream API, but hasStream is false")
	}
	const n = 64 << 10
	dev := newHostDevice(t, 1, 4*n, 0)
	fill(dev.mem[:n], 11)
	f, err := os.OpenFile(filepath.Join(t.TempDir(), "k"), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	h, err := fileHandle(e.d, int(f.Fd()))
	if err != nil {
		t.Fatal(err)
	}
	defer e.d.cache.release(h)
	const stream = 0x5eed // the fake ignores streams; the real library queues on it
	if err := e.d.api.streamRegister(stream, 0); err != nil {
		t.Fatal(err)
	}
	base := dev.Ptr()
	move := func(write bool, bufOff, fileOff int64) (int64, error) {
		a, err := e.d.api.ioAsync(write, h.h, base, n, fileOff, bufOff, stream)
		if err != nil {
			return 0, err
		}
		defer a.free()
		return a.result()
	}
	if got, err := move(true, 0, n); got != n || err != nil {
		t.Fatalf("write: %d, %v; want %d bytes", got, err, n)
	}
	if got, err := move(false, 2*n, n); got != n || err != nil {
		t.Fatalf("read: %d, %v; want %d bytes", got, err, n)
	}
	if !bytes.Equal(dev.mem[2*n:3*n], dev.mem[:n]) {
		t.Fatal("the bytes read back differ from the bytes written")
	}
	if got, err := move(false, 3*n, 4*n); got != 0 || err != nil {
		t.Fatalf("a read past the end: %d, %v; want 0 bytes and no error", got, err)
	}

	e.ctl.set(&e.ctl.ReadFailAfter, 1)
	e.ctl.set(&e.ctl.ReadFailCode, int64(statusInternalError))
	if _, err := move(false, 2*n, n); !errors.Is(err, statusInternalError) {
		t.Fatalf("a failed read: %v; want %v", err, statusInternalError)
	}
	e.ctl.set(&e.ctl.ReadFailCode, int64(syscall.EIO)) // a count of -5: a negated errno
	if _, err := move(false, 2*n, n); !errors.Is(err, syscall.EIO) {
		t.Fatalf("a read failed with -EIO: %v; want EIO", err)
	}
	e.ctl.set(&e.ctl.ReadFailAfter, 0)
	e.ctl.set(&e.ctl.AsyncError, int64(statusAsyncNotSupported))
	if _, err := move(true, 0, 0); !errors.Is(err, statusAsyncNotSupported) {
		t.Fatalf("a refused enqueue: %v; want %v", err, statusAsyncNotSupported)
	}
	e.ctl.set(&e.ctl.AsyncError, 0)
	if err := e.d.api.streamDeregister(stream); err != nil {
		t.Fatal(err)
	}
	if r, d, ios := e.ctl.get(&e.ctl.StreamsRegistered), e.ctl.get(&e.ctl.StreamsDeregistered), e.ctl.get(&e.ctl.AsyncIOs); r != 1 || d != 1 || ios != 5 {
		t.Errorf("streams registered %d, deregistered %d, I/Os enqueued %d; want 1, 1, 5", r, d, ios)
	}

	without := openFakeBuilt(t, Config{}, nil, "-DFAKE_NO_STREAM")
	if without.d.api.hasStream() {
		t.Fatal("a library without the stream API reports it")
	}
	if _, err := without.d.api.ioAsync(false, 1, base, n, 0, 0, stream); !errors.Is(err, ErrUnavailable) {
		t.Errorf("ioAsync without the API: %v; want ErrUnavailable", err)
	}
	if err := without.d.api.streamRegister(stream, 0); !errors.Is(err, ErrUnavailable) {
		t.Errorf("streamRegister without the API: %v; want ErrUnavailable", err)
	}
}

// fileHandle registers the file open at fd with cuFile through the
// driver's handle cache; the caller releases the handle. On a GPU it must
// run on a thread bound to the device (Driver.onDevice).
func fileHandle(d *Driver, fd int) (*handle, error) {
	key, err := d.cache.identify(fd)
	if err != nil {
		return nil, err
	}
	return d.cache.acquire(fd, key)
}
