package server

import (
	"errors"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

// TestUnparsableControlMessageClosesItsDescriptors: a control buffer that
// unix.ParseSocketControlMessage rejects is a protocol violation, and the
// descriptors of its SCM_RIGHTS messages that can still be located are
// closed, not leaked. The kernel writes well-formed control messages, so
// such a buffer cannot be provoked through a socket: the buffers here are
// crafted and handed to takeRights directly.
func TestUnparsableControlMessageClosesItsDescriptors(t *testing.T) {
	hdr := unix.CmsgLen(0)
	for _, tc := range []struct {
		name  string
		broke func(rights []byte) []byte // the buffer takeRights reads
	}{
		{"a header past the buffer's end follows the rights", func(rights []byte) []byte {
			bad := make([]byte, unix.CmsgSpace(0))
			h := (*unix.Cmsghdr)(unsafe.Pointer(&bad[0]))
			h.Level, h.Type = unix.SOL_SOCKET, unix.SCM_RIGHTS
			h.SetLen(1 << 20)
			return append(rights, bad...)
		}},
		{"a header shorter than itself follows the rights", func(rights []byte) []byte {
			bad := make([]byte, unix.CmsgSpace(0))
			h := (*unix.Cmsghdr)(unsafe.Pointer(&bad[0]))
			h.SetLen(hdr - 1)
			return append(rights, bad...)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var p [2]int
			if err := unix.Pipe2(p[:], unix.O_CLOEXEC|unix.O_NONBLOCK); err != nil {
				t.Fatal(err)
			}
			r, w := p[0], p[1]
			defer unix.Close(r)
			oob := tc.broke(unix.UnixRights(w))
			if _, err := unix.ParseSocketControlMessage(oob); err == nil {
				t.Fatal("the crafted control buffer parses: it tests nothing")
			}
			f := &frameReader{maxFds: 8}
			if err := f.takeRights(oob, 0, 1); !errors.Is(err, errProtocol) {
				t.Fatalf("takeRights of an unparsable control buffer: %v, want a protocol violation", err)
			}
			// The pipe's only write end was w: once it is closed a read
			// sees the end of the stream, not EAGAIN.
			var b [1]byte
			if n, err := unix.Read(r, b[:]); n != 0 || err != nil {
				unix.Close(w)
				t.Fatalf("read from the pipe: %d, %v; want end of stream: the descriptor of the unparsable message was not closed", n, err)
			}
		})
	}
}
