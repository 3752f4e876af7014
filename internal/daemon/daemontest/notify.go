package daemontest

import (
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvhost/kvhost/internal/testsock"
)

// NotifySocket is a stand-in for systemd's notification socket.
type NotifySocket struct {
	Path  string // the socket: NOTIFY_SOCKET
	bound time.Duration
	msgs  chan string
}

// NewNotifySocket listens on a notification socket, closed when t ends;
// its Expect and Drain fail t after waiting bound.
func NewNotifySocket(t testing.TB, bound time.Duration) *NotifySocket {
	t.Helper()
	n := &NotifySocket{Path: filepath.Join(testsock.Dir(t), "notify.sock"), bound: bound, msgs: make(chan string, 64)}
	conn, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: n.Path, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	go func() {
		buf := make([]byte, 4096)
		for {
			k, err := conn.Read(buf)
			if err != nil {
				close(n.msgs)
				return
			}
			n.msgs <- string(buf[:k])
		}
	}()
	return n
}

// Expect waits for a notification containing want.
func (n *NotifySocket) Expect(t testing.TB, want string) {
	t.Helper()
	timeout := time.After(n.bound)
	for {
		select {
		case m, ok := <-n.msgs:
			if !ok {
				t.Fatalf("notify socket closed before %q", want)
			}
			if strings.Contains(m, want) {
				return
			}
		case <-timeout:
			t.Fatalf("no %q notification within %v", want, n.bound)
		}
	}
}

// Drain returns the notifications received and not yet read: it sends
// one of its own, which arrives after every notification sent before,
// and reads up to it.
func (n *NotifySocket) Drain(t testing.TB) []string {
	t.Helper()
	const marker = "TEST=drain"
	conn, err := net.DialUnix("unixgram", nil, &net.UnixAddr{Name: n.Path, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := conn.Write([]byte(marker)); err != nil {
		t.Fatal(err)
	}
	var got []string
	timeout := time.After(n.bound)
	for {
		select {
		case m, ok := <-n.msgs:
			if !ok {
				t.Fatal("notify socket closed before its drain")
			}
			if m == marker {
				return got
			}
			got = append(got, m)
		case <-timeout:
			t.Fatalf("the drain's own notification did not arrive within %v", n.bound)
		}
	}
}

// Messages delivers the notifications not yet read, as they arrive; it
// is closed when the socket is.
func (n *NotifySocket) Messages() <-chan string { return n.msgs }
