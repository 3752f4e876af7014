package client_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/client"
	"github.com/kvhost/kvhost/internal/testsock"
	"github.com/kvhost/kvhost/protocol"
)

// fakeDaemon answers the Hello on the first connection to a new socket,
// then runs after with the connection.
func fakeDaemon(t *testing.T, after func(c *net.UnixConn)) string {
	t.Helper()
	return fakeDaemonWelcoming(t, &protocol.Welcome{Version: protocol.Version, MaxFrame: 4 << 20, MaxKeys: 4096, MaxKeyLen: 64, Server: "fake"}, after)
}

// fakeDaemonWelcoming answers the Hello on the first connection to a new
// socket with welcome, then runs after with the connection; it returns
// the socket's path.
func fakeDaemonWelcoming(t *testing.T, welcome *protocol.Welcome, after func(c *net.UnixConn)) string {
	t.Helper()
	sock := filepath.Join(testsock.Dir(t), "d.sock")
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		c, err := l.AcceptUnix()
		if err != nil {
			return
		}
		t.Cleanup(func() { c.Close() })
		h, _, err := readRequest(c)
		if err != nil {
			return
		}
		c.Write(protocol.AppendFrame(nil, h.ID, welcome))
		after(c)
	}()
	return sock
}

// readRequest reads one frame from c.
func readRequest(c *net.UnixConn) (protocol.Header, protocol.Message, error) {
	var hdr [protocol.HeaderSize]byte
	if _, err := io.ReadFull(c, hdr[:]); err != nil {
		return protocol.Header{}, nil, err
	}
	h, err := protocol.ParseHeader(hdr[:], 8<<20)
	if err != nil {
		return h, nil, err
	}
	body := make([]byte, h.Len)
	if _, err := io.ReadFull(c, body); err != nil {
		return h, nil, err
	}
	m, err := protocol.Decode(h.Type, body)
	return h, m, err
}

// dialFake connects to the fake daemon at sock, closed when t ends.
func dialFake(t *testing.T, sock string) *client.Client {
	t.Helper()
	c, err := client.Dial(context.Background(), sock, "t")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// within returns what ch gives, failing the test if that takes a minute
// (a call that ignores its context never returns).
func within(t *testing.T, ch chan error) error {
	t.Helper()
	select {
	case err := <-ch:
		return err
	case <-time.After(time.Minute):
		t.Fatal("the call has not returned a minute after its context ended")
		return nil
	}
}

// wantUnpin fails t unless the next request got gives, within a minute,
// is an unpin of pin, the pin named by what.
func wantUnpin(t *testing.T, got <-chan protocol.Message, pin uint64, what string) {
	t.Helper()
	select {
	case m := <-got:
		if u, ok := m.(*protocol.Unpin); !ok || u.Pin != pin {
			t.Fatalf("after the reply to %s: %#v, want an unpin of pin %d", what, m, pin)
		}
	case <-time.After(time.Minute):
		t.Fatalf("no unpin of %s", what)
	}
}

// TestACallReturnsWhenItsContextEndsWhileTheSendBlocks: a daemon that
// reads nothing (busy on a request, a hung mount) leaves a large frame's
// write blocked; the call returns when its context ends, and the client,
// its stream cut part way, sends nothing more (ErrClosed).
func TestACallReturnsWhenItsContextEndsWhileTheSendBlocks(t *testing.T) {
	started := make(chan struct{})
	sock := fakeDaemon(t, func(c *net.UnixConn) {
		io.ReadFull(c, make([]byte, 1024)) // the write has begun; nothing more is read
		close(started)
	})
	c := dialFake(t, sock)
	keys := make([][]byte, protocol.MaxKeysPerRequest)
	for i := range keys {
		keys[i] = make([]byte, protocol.MaxKeyLen)
		keys[i][0], keys[i][1] = byte(i), byte(i>>8)
	}
	done := make(chan error, 1) // the ~270 KB frame exceeds the socket's buffer
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		_, err := c.Lookup(ctx, 1, keys)
		done <- err
	}()
	<-started
	// A second call waits behind the blocked write; its own context ends
	// it there, with nothing sent.
	short, cancelShort := context.WithCancel(context.Background())
	second := make(chan error, 1)
	go func() {
		_, err := c.Stats(short)
		second <- err
	}()
	cancelShort()
	if err := within(t, second); !errors.Is(err, context.Canceled) {
		t.Fatalf("a call waiting for the blocked write: %v, want %v", err, context.Canceled)
	}
	cancel()
	if err := within(t, done); !errors.Is(err, context.Canceled) || !errors.Is(err, client.ErrClosed) {
		t.Fatalf("the blocked lookup: %v, want ErrClosed for a send cut off by %v", err, context.Canceled)
	}
	if _, err := c.Stats(context.Background()); !errors.Is(err, client.ErrClosed) {
		t.Fatalf("a call after the cut-off send: %v, want %v", err, client.ErrClosed)
	}
}

// TestAnUnknownErrorCodeIsAnErrorNotALostConnection: a newer daemon's
// error code (docs/protocol.md, Versioning) fails the call and keeps the
// connection.
func TestAnUnknownErrorCodeIsAnErrorNotALostConnection(t *testing.T) {
	sock := fakeDaemon(t, func(c *net.UnixConn) {
		for _, cd := range []protocol.Code{200, protocol.CodeInvalid} {
			h, _, err := readRequest(c)
			if err != nil {
				return
			}
			c.Write(protocol.AppendFrame(nil, h.ID, &protocol.Error{Code: cd, Message: "a newer daemon's error"}))
		}
	})
	c := dialFake(t, sock)
	var pe *protocol.Error
	if _, err := c.Stats(context.Background()); !errors.As(err, &pe) || pe.Code != 200 {
		t.Errorf("first call: %v, want a *protocol.Error with code 200", err)
	}
	if _, err := c.Stats(context.Background()); !errors.As(err, &pe) || pe.Code != protocol.CodeInvalid {
		t.Errorf("second call: %v, want the daemon's %s (the connection still up)", err, protocol.CodeInvalid)
	}
}

// TestAPinAbandonedAfterItsSendIsUnpinned: a Pin whose context ends after
// the request went out returns the context's error, and when the Pinned
// reply comes the client unpins it: the caller holds no pin it cannot
// name.
func TestAPinAbandonedAfterItsSendIsUnpinned(t *testing.T) {
	got := make(chan protocol.Message, 2)
	answer := make(chan struct{})
	sock := fakeDaemon(t, func(c *net.UnixConn) {
		h, m, err := readRequest(c)
		if err != nil {
			return
		}
		got <- m
		<-answer
		c.Write(protocol.AppendFrame(nil, h.ID, &protocol.Pinned{Pin: 7, State: []uint8{protocol.PinHeld}}))
		h, m, err = readRequest(c)
		if err != nil {
			return
		}
		got <- m
		c.Write(protocol.AppendFrame(nil, h.ID, &protocol.Count{T: protocol.TypeUnpin | protocol.TypeReply, Count: 1}))
	})
	c := dialFake(t, sock)
	ctx, cancel := context.WithCancel(context.Background())
	pinned := make(chan error, 1)
	go func() {
		_, err := c.Pin(ctx, 1, [][]byte{[]byte("key")}, 0)
		pinned <- err
	}()
	if m := <-got; m.Type() != protocol.TypePin {
		t.Fatalf("first request %s, want a pin", m.Type())
	}
	cancel()
	if err := within(t, pinned); !errors.Is(err, context.Canceled) {
		t.Fatalf("Pin: %v, want %v", err, context.Canceled)
	}
	close(answer)
	wantUnpin(t, got, 7, "the abandoned pin")
}

// TestACancelRacingASendLeavesNoDeadline: a context that ends while a
// small request is written (the write completes anyway) leaves no past
// write deadline on the connection: the next call, its context live, is
// answered. The cut runs on its own goroutine, which may set the deadline
// after the write returned.
func TestACancelRacingASendLeavesNoDeadline(t *testing.T) {
	sock := fakeDaemon(t, func(c *net.UnixConn) {
		for {
			h, _, err := readRequest(c)
			if err != nil {
				return
			}
			c.Write(protocol.AppendFrame(nil, h.ID, &protocol.Error{Code: protocol.CodeInvalid, Message: "x"}))
		}
	})
	c := dialFake(t, sock)
	for i := range 2000 {
		ctx, cancel := context.WithCancel(context.Background())
		go cancel()
		c.Stats(ctx)
		cancel()
		var pe *protocol.Error
		if _, err := c.Stats(context.Background()); !errors.As(err, &pe) {
			t.Fatalf("round %d: a call with a live context after a cancelled one: %v, want the daemon's answer", i, err)
		}
	}
}

// TestAJobAcceptedBeforeAFailedSendStillCompletes: once a write fails
// part way, nothing more is sent, but the connection is read on: a job
// the daemon accepted before ends with its completion, not ErrClosed.
func TestAJobAcceptedBeforeAFailedSendStillCompletes(t *testing.T) {
	started := make(chan struct{})
	complete := make(chan struct{})
	sock := fakeDaemon(t, func(c *net.UnixConn) {
		h, _, err := readRequest(c) // the store
		if err != nil {
			return
		}
		c.Write(protocol.AppendFrame(nil, h.ID, &protocol.JobAccepted{T: protocol.TypeStore | protocol.TypeReply, Job: 5}))
		io.ReadFull(c, make([]byte, 1024)) // a large frame's write has begun; nothing more is read
		close(started)
		<-complete
		c.Write(protocol.AppendFrame(nil, 0, &protocol.Completion{Job: 5, Kind: protocol.JobStore,
			Keys: []protocol.KeyOutcome{{Outcome: protocol.OutcomeStored}}}))
	})
	c := dialFake(t, sock)
	job, err := c.Store(context.Background(), 1, [][]byte{[]byte("k")}, [][]uint32{{0}})
	if err != nil {
		t.Fatal(err)
	}
	keys := make([][]byte, protocol.MaxKeysPerRequest)
	for i := range keys {
		keys[i] = make([]byte, protocol.MaxKeyLen)
		keys[i][0], keys[i][1] = byte(i), byte(i>>8)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		_, err := c.Lookup(ctx, 1, keys)
		done <- err
	}()
	<-started
	cancel()
	if err := within(t, done); !errors.Is(err, client.ErrClosed) {
		t.Fatalf("the cut-off lookup: %v, want %v", err, client.ErrClosed)
	}
	close(complete)
	res, err := job.Wait(context.Background())
	if err != nil || res.Keys[0].Outcome != client.OutcomeStored {
		t.Fatalf("the job accepted before the failed send: %+v, %v; want it stored", res, err)
	}
}

// TestAStoreWhoseContextEndsBeforeItIsAcceptedReturnsItsJob: a daemon that
// read a Store and has not answered it (busy on an earlier request, a hung
// mount) does not hold the caller past its context: Store returns the Job
// with the context's error. The Job is bound to the daemon's id and
// cancelled once the acceptance comes, and it ends with its completion,
// not before: until then the daemon may be using the blocks.
func TestAStoreWhoseContextEndsBeforeItIsAcceptedReturnsItsJob(t *testing.T) {
	got := make(chan protocol.Message, 2)
	accept := make(chan struct{})
	sock := fakeDaemon(t, func(c *net.UnixConn) {
		h, m, err := readRequest(c)
		if err != nil {
			return
		}
		got <- m
		<-accept
		c.Write(protocol.AppendFrame(nil, h.ID, &protocol.JobAccepted{T: protocol.TypeStore | protocol.TypeReply, Job: 5}))
		h, m, err = readRequest(c)
		if err != nil {
			return
		}
		got <- m
		c.Write(protocol.AppendFrame(nil, h.ID, &protocol.Cancelled{InFlight: true}))
		c.Write(protocol.AppendFrame(nil, 0, &protocol.Completion{Job: 5, Kind: protocol.JobStore,
			Keys: []protocol.KeyOutcome{{Outcome: protocol.OutcomeCancelled, Code: protocol.CodeCancelled}}}))
	})
	c := dialFake(t, sock)
	ctx, cancel := context.WithCancel(context.Background())
	var job *client.Job
	stored := make(chan error, 1)
	go func() {
		var err error
		job, err = c.Store(ctx, 1, [][]byte{[]byte("k")}, [][]uint32{{0}})
		stored <- err
	}()
	if m := <-got; m.Type() != protocol.TypeStore {
		t.Fatalf("first request %s, want a store", m.Type())
	}
	cancel()
	if err := within(t, stored); !errors.Is(err, context.Canceled) || job == nil {
		t.Fatalf("Store: job %v, %v; want its Job and %v", job, err, context.Canceled)
	}
	select {
	case <-job.Done():
		t.Fatal("the Job ended before the daemon accepted it")
	default:
	}
	close(accept)
	select {
	case m := <-got:
		if cm, ok := m.(*protocol.Cancel); !ok || cm.Job != 5 {
			t.Fatalf("after the abandoned store's acceptance: %#v, want a cancel of job 5", m)
		}
	case <-time.After(time.Minute):
		t.Fatal("no cancel of the abandoned store")
	}
	res, err := job.Wait(context.Background())
	if err != nil || len(res.Keys) != 1 || res.Keys[0].Outcome != client.OutcomeCancelled || job.ID() != 5 {
		t.Fatalf("the abandoned store's Job %d: %+v, %v; want job 5 cancelled", job.ID(), res, err)
	}
}

// TestALoadWhoseContextEndsBeforeTheDaemonRefusesItEndsWithTheRefusal: a
// Load that returned its Job with the context's error, refused when the
// daemon's answer comes, ends with the daemon's error: no job ran.
func TestALoadWhoseContextEndsBeforeTheDaemonRefusesItEndsWithTheRefusal(t *testing.T) {
	read := make(chan struct{})
	answer := make(chan struct{})
	sock := fakeDaemon(t, func(c *net.UnixConn) {
		h, _, err := readRequest(c)
		if err != nil {
			return
		}
		close(read)
		<-answer
		c.Write(protocol.AppendFrame(nil, h.ID, &protocol.Error{Code: protocol.CodeUnknownCache, Message: "cache 1"}))
	})
	c := dialFake(t, sock)
	ctx, cancel := context.WithCancel(context.Background())
	var job *client.Job
	loaded := make(chan error, 1)
	go func() {
		var err error
		job, err = c.Load(ctx, 1, [][]byte{[]byte("k")}, [][]uint32{{0}})
		loaded <- err
	}()
	<-read
	cancel()
	if err := within(t, loaded); !errors.Is(err, context.Canceled) || job == nil {
		t.Fatalf("Load: job %v, %v; want its Job and %v", job, err, context.Canceled)
	}
	close(answer)
	var pe *protocol.Error
	if _, err := job.Wait(context.Background()); !errors.As(err, &pe) || pe.Code != protocol.CodeUnknownCache {
		t.Fatalf("the refused load's Job: %v, want the daemon's %s", err, protocol.CodeUnknownCache)
	}
	if in, err := job.Cancel(context.Background()); in || err != nil {
		t.Fatalf("Cancel of the refused load: %v, %v; want false (nothing in flight)", in, err)
	}
}

// TestAJobIDAcceptedTwiceFailsTheConnection: a daemon that names a job
// still in flight again for another request breaks the protocol (the
// completions could not be told apart): the connection fails, and both
// jobs end with ErrClosed rather than one of them never ending.
func TestAJobIDAcceptedTwiceFailsTheConnection(t *testing.T) {
	sock := fakeDaemon(t, func(c *net.UnixConn) {
		for {
			h, _, err := readRequest(c)
			if err != nil {
				return
			}
			c.Write(protocol.AppendFrame(nil, h.ID, &protocol.JobAccepted{T: protocol.TypeStore | protocol.TypeReply, Job: 5}))
		}
	})
	c := dialFake(t, sock)
	first, err := c.Store(context.Background(), 1, [][]byte{[]byte("a")}, [][]uint32{{0}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Store(context.Background(), 1, [][]byte{[]byte("b")}, [][]uint32{{1}}); !errors.Is(err, client.ErrClosed) {
		t.Errorf("a store accepted as job 5 again: %v, want %v", err, client.ErrClosed)
	}
	c.Close()
	waited := make(chan error, 1)
	go func() {
		_, err := first.Wait(context.Background())
		waited <- err
	}()
	select {
	case err := <-waited:
		if !errors.Is(err, client.ErrClosed) {
			t.Fatalf("the first job 5: %v, want %v", err, client.ErrClosed)
		}
	case <-time.After(time.Minute):
		t.Fatal("the first job 5 has not ended a minute after the connection was closed")
	}
}

// TestACompletionThatDoesNotMatchItsRequestFailsTheConnection: a
// completion with another number of keys than the request (a caller
// indexing Result.Keys by request key would go out of range), of the
// other kind of job, or with a key that docs/protocol.md rules out (still
// pending; failed without a code, which Result.Err would report as "ok")
// is not handed to the caller: the connection fails and the Job ends with
// ErrClosed.
func TestACompletionThatDoesNotMatchItsRequestFailsTheConnection(t *testing.T) {
	stored := protocol.KeyOutcome{Outcome: protocol.OutcomeStored}
	for _, tc := range []struct {
		name string
		kind protocol.JobKind
		keys []protocol.KeyOutcome
	}{
		{"fewer keys", protocol.JobStore, []protocol.KeyOutcome{stored, stored}},
		{"more keys", protocol.JobStore, []protocol.KeyOutcome{stored, stored, stored, stored}},
		{"a load's", protocol.JobLoad, []protocol.KeyOutcome{{Outcome: protocol.OutcomeLoaded}, {Outcome: protocol.OutcomeLoaded}, {Outcome: protocol.OutcomeLoaded}}},
		{"a key pending", protocol.JobStore, []protocol.KeyOutcome{stored, {Outcome: protocol.OutcomePending}, stored}},
		{"a failed key without a code", protocol.JobStore, []protocol.KeyOutcome{stored, {Outcome: protocol.OutcomeFailed}, stored}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sock := fakeDaemon(t, func(c *net.UnixConn) {
				h, _, err := readRequest(c)
				if err != nil {
					return
				}
				c.Write(protocol.AppendFrame(nil, h.ID, &protocol.JobAccepted{T: protocol.TypeStore | protocol.TypeReply, Job: 5}))
				c.Write(protocol.AppendFrame(nil, 0, &protocol.Completion{Job: 5, Kind: tc.kind, Keys: tc.keys}))
				readRequest(c) // until the client closes
			})
			c := dialFake(t, sock)
			keys := [][]byte{[]byte("a"), []byte("b"), []byte("c")}
			job, err := c.Store(context.Background(), 1, keys, [][]uint32{{0}, {1}, {2}})
			if err != nil {
				t.Fatal(err)
			}
			if res, err := job.Wait(context.Background()); !errors.Is(err, client.ErrClosed) {
				t.Fatalf("a store of %d keys completed with %+v, %v; want %v", len(keys), res, err, client.ErrClosed)
			}
		})
	}
}

// TestALostConnectionSaysWhoClosedIt: a call the connection's end cuts
// off fails with ErrClosed saying whether the daemon closed the
// connection (between frames, or in the middle of one: it died while
// writing a reply) or this client did (Close), so that a log line tells
// an operator where to look.
func TestALostConnectionSaysWhoClosedIt(t *testing.T) {
	for _, tc := range []struct {
		name   string
		daemon bool   // the daemon closes the connection; else the client
		sent   []byte // what the daemon writes before it closes
		want   string
	}{
		{"the daemon", true, nil, "the daemon closed the connection"},
		{"the daemon in a reply's header", true, make([]byte, protocol.HeaderSize-1), "the daemon closed the connection in the middle of a frame"},
		{"the daemon after a reply's header", true, protocol.AppendFrame(nil, 2, &protocol.Stats{})[:protocol.HeaderSize], "the daemon closed the connection in the middle of a frame"},
		{"the daemon in a reply's body", true, protocol.AppendFrame(nil, 2, &protocol.Stats{})[:protocol.HeaderSize+10], "the daemon closed the connection in the middle of a frame"},
		{"the client", false, nil, "closed by the client"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			read := make(chan struct{})
			sock := fakeDaemon(t, func(c *net.UnixConn) {
				if _, _, err := readRequest(c); err != nil {
					return
				}
				close(read)
				if tc.daemon {
					c.Write(tc.sent)
					c.Close()
				}
			})
			c := dialFake(t, sock)
			done := make(chan error, 1)
			go func() {
				_, err := c.Stats(context.Background())
				done <- err
			}()
			<-read
			if !tc.daemon {
				c.Close()
			}
			if err := within(t, done); !errors.Is(err, client.ErrClosed) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("the call cut off: %v; want %v saying %q", err, client.ErrClosed, tc.want)
			}
		})
	}
}

// TestAReplyOfAnotherTypeFailsTheConnection: a daemon that answers a
// request with another request's reply (or with a request) is out of
// step with the client: the call fails with ErrClosed naming both
// types, and so does every later call, rather than ErrClosed for one
// call on a connection that goes on.
func TestAReplyOfAnotherTypeFailsTheConnection(t *testing.T) {
	for _, tc := range []struct {
		name  string
		reply protocol.Message
	}{
		{"a lookup's reply", &protocol.Count{T: protocol.TypeLookup | protocol.TypeReply, Count: 1}},
		{"a request", &protocol.Cancel{Job: 1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sock := fakeDaemon(t, func(c *net.UnixConn) {
				h, _, err := readRequest(c)
				if err != nil {
					return
				}
				c.Write(protocol.AppendFrame(nil, h.ID, tc.reply))
				for {
					h, _, err := readRequest(c)
					if err != nil {
						return
					}
					c.Write(protocol.AppendFrame(nil, h.ID, &protocol.Stats{}))
				}
			})
			c := dialFake(t, sock)
			_, err := c.Stats(context.Background())
			if !errors.Is(err, client.ErrClosed) || !strings.Contains(err.Error(), tc.reply.Type().String()) {
				t.Fatalf("stats answered with %s: %v; want %v naming it", tc.reply.Type(), err, client.ErrClosed)
			}
			if _, err := c.Stats(context.Background()); !errors.Is(err, client.ErrClosed) {
				t.Fatalf("a call after the daemon answered stats with %s: %v; want %v", tc.reply.Type(), err, client.ErrClosed)
			}
		})
	}
}

// TestAConnectionTheClientEndsSaysTheDaemonMayStillUseTheBlocks: when
// the client ends the connection (Close, or a frame it refuses) the
// daemon may go on copying to or from the blocks of the jobs it had
// accepted or read until it notices and cancels them: the Job of an
// accepted store and a Store still waiting for its answer fail with an
// error that says so (ErrBlocksInUse) as well as ErrClosed. When the
// daemon closed the connection it had ended its jobs first: ErrClosed
// alone.
func TestAConnectionTheClientEndsSaysTheDaemonMayStillUseTheBlocks(t *testing.T) {
	for _, tc := range []struct {
		name  string
		end   func(d *net.UnixConn, c *client.Client) // ends the connection
		inUse bool
	}{
		{"Close", func(_ *net.UnixConn, c *client.Client) { c.Close() }, true},
		{"a frame the client refuses", func(d *net.UnixConn, _ *client.Client) {
			d.Write(protocol.AppendFrame(nil, 0, &protocol.Empty{T: 0x0777}))
		}, true},
		{"the daemon closes", func(d *net.UnixConn, _ *client.Client) { d.Close() }, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			daemon := make(chan *net.UnixConn, 1)
			sock := fakeDaemon(t, func(c *net.UnixConn) {
				h, _, err := readRequest(c)
				if err != nil {
					return
				}
				c.Write(protocol.AppendFrame(nil, h.ID, &protocol.JobAccepted{T: protocol.TypeStore | protocol.TypeReply, Job: 5}))
				if _, _, err := readRequest(c); err != nil { // the second store: read, not answered
					return
				}
				daemon <- c
				readRequest(c) // until the connection ends
			})
			c := dialFake(t, sock)
			job, err := c.Store(context.Background(), 1, [][]byte{[]byte("a")}, [][]uint32{{0}})
			if err != nil {
				t.Fatal(err)
			}
			second := make(chan error, 1)
			go func() {
				_, err := c.Store(context.Background(), 1, [][]byte{[]byte("b")}, [][]uint32{{1}})
				second <- err
			}()
			tc.end(<-daemon, c)
			_, waited := job.Wait(context.Background())
			for what, err := range map[string]error{"the accepted job's Wait": waited, "the unanswered Store": within(t, second)} {
				if !errors.Is(err, client.ErrClosed) || errors.Is(err, client.ErrBlocksInUse) != tc.inUse {
					t.Errorf("%s: %v; want %v, and %v: %v", what, err, client.ErrClosed, client.ErrBlocksInUse, tc.inUse)
				}
			}
		})
	}
}

// TestCancelOfAJobOfAnotherClientIsRefused: a Job belongs to the
// connection that started it, and job ids are the daemon's, shared by
// its connections: cancelling one client's Job through another would
// ask that connection's daemon session, which answers "not in flight",
// a false report of a job still running. It fails with ErrInvalid
// before anything is sent, as does a nil Job.
func TestCancelOfAJobOfAnotherClientIsRefused(t *testing.T) {
	answer := func(c *net.UnixConn) {
		for {
			h, m, err := readRequest(c)
			if err != nil {
				return
			}
			switch m.(type) {
			case *protocol.Transfer:
				c.Write(protocol.AppendFrame(nil, h.ID, &protocol.JobAccepted{T: protocol.TypeStore | protocol.TypeReply, Job: 5}))
			case *protocol.Cancel:
				c.Write(protocol.AppendFrame(nil, h.ID, &protocol.Cancelled{InFlight: false}))
			}
		}
	}
	a, b := dialFake(t, fakeDaemon(t, answer)), dialFake(t, fakeDaemon(t, answer))
	job, err := a.Store(context.Background(), 1, [][]byte{[]byte("k")}, [][]uint32{{0}})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		job  *client.Job
	}{
		{"another client's", job},
		{"a nil", nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if in, err := b.Cancel(context.Background(), tc.job); !errors.Is(err, client.ErrInvalid) {
				t.Fatalf("Cancel of %s Job: %v, %v; want %v", tc.name, in, err, client.ErrInvalid)
			}
		})
	}
}

// TestAWelcomeOfAnotherVersionIsRefusedNamingIt: a daemon that answers
// Hello with a Welcome of a version this client does not speak (it
// should have refused the Hello) fails Dial with an error that names
// both versions.
func TestAWelcomeOfAnotherVersionIsRefusedNamingIt(t *testing.T) {
	sock := fakeDaemonWelcoming(t, &protocol.Welcome{Version: protocol.Version + 1, MaxFrame: protocol.MinFrame}, func(c *net.UnixConn) {
		readRequest(c) // until the client closes
	})
	c, err := client.Dial(context.Background(), sock, "t")
	if err == nil {
		c.Close()
		t.Fatal("Dial accepted a Welcome of another version")
	}
	if want := fmt.Sprintf("protocol version %d; this client speaks version %d", protocol.Version+1, protocol.Version); !strings.Contains(err.Error(), want) {
		t.Fatalf("Dial: %v; want it to say %q", err, want)
	}
}

// TestAPinReplyForOtherKeysIsUnpinned: a Pinned reply whose states do
// not match the request's keys fails Pin (the caller cannot tell which
// keys it holds), and the pin the daemon made is given back rather than
// held, unnamed, until the connection ends.
func TestAPinReplyForOtherKeysIsUnpinned(t *testing.T) {
	got := make(chan protocol.Message, 1)
	sock := fakeDaemon(t, func(c *net.UnixConn) {
		h, _, err := readRequest(c)
		if err != nil {
			return
		}
		c.Write(protocol.AppendFrame(nil, h.ID, &protocol.Pinned{Pin: 7, State: []uint8{protocol.PinHeld, protocol.PinHeld}}))
		h, m, err := readRequest(c)
		if err != nil {
			return
		}
		got <- m
		c.Write(protocol.AppendFrame(nil, h.ID, &protocol.Count{T: protocol.TypeUnpin | protocol.TypeReply, Count: 2}))
	})
	c := dialFake(t, sock)
	if _, err := c.Pin(context.Background(), 1, [][]byte{[]byte("key")}, 0); !errors.Is(err, protocol.ErrMalformed) {
		t.Fatalf("Pin of 1 key answered with 2 states: %v, want %v", err, protocol.ErrMalformed)
	}
	wantUnpin(t, got, 7, "the pin whose reply did not match its keys")
}

// TestAWriteCutByTheReadLoopReportsTheReadLoopsReason: a request whose
// write is under way when the read loop finds the other end's bytes are
// no kvhost frame (another program's socket) and closes the connection
// fails with the read loop's reason, not with the write's "use of closed
// network connection".
func TestAWriteCutByTheReadLoopReportsTheReadLoopsReason(t *testing.T) {
	const keys, keyLen = protocol.MaxKeysPerRequest, protocol.MaxKeyLen // a Lookup of 270 KiB: more than the socket holds
	welcome := &protocol.Welcome{Version: protocol.Version, MaxFrame: 8 << 20, MaxKeys: keys, MaxKeyLen: keyLen, Server: "fake"}
	sock := fakeDaemonWelcoming(t, welcome, func(c *net.UnixConn) {
		// Once the Lookup's first bytes are here its write has begun,
		// and blocks, as this end reads nothing: answer with bytes that
		// are no kvhost frame.
		raw, err := c.SyscallConn()
		if err != nil {
			return
		}
		for queued := 0; queued == 0; {
			raw.Control(func(fd uintptr) { queued, _ = unix.IoctlGetInt(int(fd), unix.SIOCINQ) })
			runtime.Gosched()
		}
		io.WriteString(c, "HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
	})
	cl := dialFake(t, sock)
	ks := make([][]byte, keys)
	for i := range ks {
		ks[i] = []byte(fmt.Sprintf("%064d", i))
	}
	_, err := cl.Lookup(context.Background(), 1, ks)
	if err == nil {
		t.Fatal("a Lookup answered with bytes that are no kvhost frame succeeded")
	}
	if !errors.Is(err, protocol.ErrMalformed) && !errors.Is(err, protocol.ErrTooLarge) && !errors.Is(err, protocol.ErrUnknownType) {
		t.Errorf("Lookup: %v; want the read loop's reason: the answer is no kvhost frame", err)
	}
}
