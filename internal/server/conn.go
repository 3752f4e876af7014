package server

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/protocol"
)

// maxFdsPerMsg is the most descriptors one recvmsg accepts; more is a
// protocol violation (the kernel truncates and closes the rest).
const maxFdsPerMsg = 8

// frameReader reads frames from a Unix stream and collects the descriptors
// that arrive with them (SCM_RIGHTS) in order. A descriptor belongs to the
// frame whose first byte it is sent with. The kernel hands it over with
// the read that brings the first bytes of the sendmsg it came in, a read
// that may begin with earlier bytes but takes nothing sent after that
// sendmsg; so the frame it belongs to begins within that read, and the
// read ends within that frame (a frame with descriptors is sent in a
// sendmsg of its own). A frame takes (takeFd) only descriptors whose read
// began at or before the frame's first byte and ended within it: earlier
// frames read with it do not take its descriptor. Once a frame is answered
// (done) the descriptors whose read ended within it or before are closed,
// claimed or not: they belong to it or to a frame before it, never to a
// later one.
//
// Reads are bounded in time: the wait for a frame's first byte ends at a
// deadline the caller gives (the handshake or idle limit), and once that
// byte has arrived the rest of the frame must follow within frameTimeout,
// so that a client that stops in the middle of a frame cannot hold its
// session (and what it pins) for ever.
//
// A frame's body is allocated once its header is read. Where room is set,
// a body of more than UncountedBody bytes first takes room for itself
// (which may wait: the frame's deadline then counts from the end of the
// wait) and holds it until the frame is answered (done).
type frameReader struct {
	conn         *net.UnixConn
	buf          []byte
	r, w         int
	oob          []byte
	fds          []rights // unclaimed, oldest first
	pos          int64    // stream offset of buf[w]: the bytes read so far
	frame        [2]int64 // stream offsets of the frame last read: [start, end)
	maxFds       int
	maxFrame     int
	frameTimeout time.Duration
	deadline     time.Time // the read deadline set on conn
	// hold, if set, is asked to count each descriptor received; with
	// the error it returns, the descriptor is closed at once and the
	// frame that claims it gets that error (takeFd). drop is called for
	// each counted descriptor the reader closes.
	hold func() *protocol.Error
	drop func()
	// room, if set, takes room for a body of n bytes, waiting until
	// there is, and reports whether it waited; free gives it back. held
	// is what the frame last read holds.
	room func(n int) (waited bool, err error)
	free func(n int)
	held int
}

func newFrameReader(c *net.UnixConn, maxFrame, maxFds int, frameTimeout time.Duration) *frameReader {
	return &frameReader{
		conn:         c,
		buf:          make([]byte, 64<<10),
		oob:          make([]byte, unix.CmsgSpace(4*maxFdsPerMsg)),
		maxFds:       maxFds,
		maxFrame:     maxFrame,
		frameTimeout: frameTimeout,
	}
}

// rights is a descriptor received and the stream offsets [start, end) of
// the read that brought it; fd is -1 where it was closed at once, refused
// for the reason in refused.
type rights struct {
	fd         int
	start, end int64
	refused    *protocol.Error
}

var (
	// errProtocol marks errors after which the stream cannot be trusted.
	errProtocol = errors.New("server: protocol violation")
	// errWaitTimeout: no frame began before the caller's deadline.
	errWaitTimeout = errors.New("server: no frame before the deadline")
	// errFrameTimeout: a frame began but did not complete in time.
	errFrameTimeout = errors.New("server: frame incomplete at its deadline")
)

// setDeadline sets the connection's read deadline (zero: none) unless it
// is already set: the common case of back-to-back frames costs nothing.
func (f *frameReader) setDeadline(t time.Time) {
	if !t.Equal(f.deadline) {
		f.conn.SetReadDeadline(t)
		f.deadline = t
	}
}

func (f *frameReader) fill() error {
	if f.r == f.w {
		f.r, f.w = 0, 0
	}
	n, oobn, flags, _, err := f.conn.ReadMsgUnix(f.buf[f.w:], f.oob)
	start := f.pos
	f.pos += int64(n)
	if oobn > 0 {
		if perr := f.takeRights(f.oob[:oobn], start, f.pos); perr != nil {
			return perr
		}
	}
	if flags&unix.MSG_CTRUNC != 0 {
		return fmt.Errorf("%w: more than %d descriptors in one message", errProtocol, maxFdsPerMsg)
	}
	f.w += n
	if n > 0 {
		return nil
	}
	if err == nil {
		err = io.EOF
	}
	return err
}

func (f *frameReader) takeRights(oob []byte, start, end int64) error {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		closeRights(oob)
		return fmt.Errorf("%w: control message: %w", errProtocol, err)
	}
	var bad error
	for _, m := range msgs {
		fds, err := unix.ParseUnixRights(&m)
		if err != nil {
			continue // credentials or other control data: ignored
		}
		for _, fd := range fds {
			if len(f.fds) >= f.maxFds {
				unix.Close(fd)
				bad = fmt.Errorf("%w: more than %d descriptors not yet claimed by a registration", errProtocol, f.maxFds)
				continue
			}
			if f.hold != nil {
				if e := f.hold(); e != nil {
					unix.Close(fd)
					f.fds = append(f.fds, rights{fd: -1, start: start, end: end, refused: e})
					continue
				}
			}
			f.fds = append(f.fds, rights{fd: fd, start: start, end: end})
		}
	}
	return bad
}

// closeRights closes the descriptors of the SCM_RIGHTS messages in a
// control buffer that unix.ParseSocketControlMessage rejects, as far as its
// headers can be followed: those before the first malformed header. The
// kernel writes well-formed control messages, so this is a guard, not a
// path a client can take.
func closeRights(oob []byte) {
	for len(oob) >= unix.CmsgLen(0) {
		var h unix.Cmsghdr
		copy(unsafe.Slice((*byte)(unsafe.Pointer(&h)), unix.SizeofCmsghdr), oob)
		n := int(h.Len)
		if n < unix.CmsgLen(0) || n > len(oob) {
			return
		}
		if h.Level == unix.SOL_SOCKET && h.Type == unix.SCM_RIGHTS {
			for data := oob[unix.CmsgLen(0):n]; len(data) >= 4; data = data[4:] {
				unix.Close(int(int32(binary.NativeEndian.Uint32(data))))
			}
		}
		// The next header begins at the aligned end of this message.
		oob = oob[min(unix.CmsgSpace(n-unix.CmsgLen(0)), len(oob)):]
	}
}

// readFull reads len(p) bytes of a frame that has begun. Before it first
// blocks it sets the frame's deadline *dl (now + frameTimeout, or by if
// that is earlier and not zero).
func (f *frameReader) readFull(p []byte, dl *time.Time, by time.Time) error {
	for len(p) > 0 {
		if f.r == f.w {
			if dl.IsZero() {
				*dl = time.Now().Add(f.frameTimeout)
				if !by.IsZero() && by.Before(*dl) {
					*dl = by
				}
			}
			f.setDeadline(*dl)
			if err := f.fill(); err != nil {
				if errors.Is(err, os.ErrDeadlineExceeded) {
					return fmt.Errorf("%w (%d bytes missing): %w", errFrameTimeout, len(p), err)
				}
				return err
			}
		}
		k := copy(p, f.buf[f.r:f.w])
		f.r += k
		p = p[k:]
	}
	return nil
}

// next reads one frame. The wait for its first byte ends at wait (zero: no
// limit) with errWaitTimeout; the rest must arrive within frameTimeout of
// that byte, and by by if that is not zero, or next fails with
// errFrameTimeout. Its body is freshly allocated: decoded messages alias it
// and the engine may keep keys after the handler returns.
func (f *frameReader) next(wait, by time.Time) (protocol.Header, []byte, error) {
	if f.r == f.w {
		f.setDeadline(wait)
		if err := f.fill(); err != nil {
			if errors.Is(err, os.ErrDeadlineExceeded) {
				err = fmt.Errorf("%w: %w", errWaitTimeout, err)
			}
			return protocol.Header{}, nil, err
		}
	}
	f.frame[0] = f.offset()
	var dl time.Time // the frame's deadline, once one is needed
	var hdr [protocol.HeaderSize]byte
	if err := f.readFull(hdr[:], &dl, by); err != nil {
		if errors.Is(err, io.EOF) {
			err = io.ErrUnexpectedEOF
		}
		return protocol.Header{}, nil, err
	}
	h, err := protocol.ParseHeader(hdr[:], f.maxFrame)
	if err != nil {
		return h, nil, err
	}
	if f.room != nil && h.Len > UncountedBody {
		waited, err := f.room(int(h.Len))
		if err != nil {
			return h, nil, err
		}
		f.held = int(h.Len)
		if waited {
			dl = time.Time{} // the client was not late: the daemon was full
		}
	}
	body := make([]byte, h.Len)
	if err := f.readFull(body, &dl, by); err != nil {
		f.giveRoom()
		if errors.Is(err, io.EOF) {
			err = io.ErrUnexpectedEOF
		}
		return h, nil, err
	}
	f.frame[1] = f.offset()
	return h, body, nil
}

// offset is the stream offset of the next byte to be read from buf.
func (f *frameReader) offset() int64 { return f.pos - int64(f.w-f.r) }

// takeFd claims for the frame last read the oldest unclaimed descriptor
// that can belong to it, or returns -1: with the error its hold gave
// where that descriptor was refused, with nil where there is none. The
// read that brought a frame's descriptor began at or before the frame's
// first byte and ended within the frame (it took nothing sent after the
// frame's sendmsg), so a descriptor whose read ended past the frame is a
// later frame's, even though its read began with this one. A descriptor
// taken is the caller's to close, and to give back to drop.
func (f *frameReader) takeFd() (int, *protocol.Error) {
	if len(f.fds) == 0 || f.fds[0].start > f.frame[0] || f.fds[0].end > f.frame[1] {
		return -1, nil // none, or a later frame's: its read began after this frame or ended past it
	}
	r := f.fds[0]
	f.fds = f.fds[1:]
	return r.fd, r.refused
}

// giveRoom gives back the room the frame last read holds.
func (f *frameReader) giveRoom() {
	if f.held > 0 {
		f.free(f.held)
		f.held = 0
	}
}

// done closes the descriptors that belong to the frame last read, or to
// one before it, and that no handler claimed, and gives back its room:
// the frame has been answered.
func (f *frameReader) done() {
	f.giveRoom()
	n := 0
	for n < len(f.fds) && f.fds[n].end <= f.frame[1] {
		f.close(f.fds[n])
		n++
	}
	f.fds = f.fds[n:]
}

// closeFds closes every unclaimed descriptor, and gives back the room of
// a frame read and not answered.
func (f *frameReader) closeFds() {
	f.giveRoom()
	for _, r := range f.fds {
		f.close(r)
	}
	f.fds = nil
}

// close closes an unclaimed descriptor (none where it was refused) and
// gives it back.
func (f *frameReader) close(r rights) {
	if r.fd < 0 {
		return
	}
	unix.Close(r.fd)
	if f.drop != nil {
		f.drop()
	}
}
