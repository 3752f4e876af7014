package reliability

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvhost/kvhost/client"
	"github.com/kvhost/kvhost/internal/testsock"
	"github.com/kvhost/kvhost/protocol"
)

// serveDeadline is how long a well-behaved new client may take to be
// served (dial, handshake, register, declare, store, load) while hostile
// clients hold the daemon: refusals are retried until then. It bounds the
// daemon's closing of hostile connections too. Where the daemon frees
// slots by a deadline of its own (frame_timeout, 10 s by default, for
// frames begun and not finished), a client is served only after it: the
// bound is 4.5 times that, so that a slow machine cannot make a correct
// daemon miss it, and below idle_timeout (60 s), so that a daemon that
// frees those slots only when they go idle still fails.
const serveDeadline = 45 * time.Second

// hostileCounts are one hostile case's results.
type hostileCounts struct {
	name       string
	hostile    int           // hostile connections opened
	closed     int           // of those, closed by the daemon within the deadline
	served     int           // well-behaved clients served within the deadline
	notServed  int           // and not
	maxLatency time.Duration // the slowest well-behaved client
}

func (c *hostileCounts) String() string {
	return fmt.Sprintf("hostile %s: hostile_conns=%d closed_by_daemon=%d served=%d not_served=%d max_latency=%v",
		c.name, c.hostile, c.closed, c.served, c.notServed, c.maxLatency.Round(time.Millisecond))
}

// probe runs one well-behaved client against socket, retrying refusals,
// until it has stored and loaded a key byte for byte or serveDeadline
// passed, and records the outcome in counts.
func probe(t *testing.T, socket string, n int, counts *hostileCounts) {
	t.Helper()
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), serveDeadline)
	defer cancel()
	var first, last error // the first refusal, and the last
	for {
		if last = probeOnce(ctx, socket, fmt.Sprintf("probe-%s-%d", counts.name, n)); last == nil {
			break
		}
		if first == nil {
			first = last
		}
		if ctx.Err() != nil {
			counts.notServed++
			t.Errorf("a well-behaved client was not served within %v: first refusal: %v; last: %v", serveDeadline, first, last)
			return
		}
		select {
		case <-ctx.Done():
		case <-time.After(100 * time.Millisecond):
		}
	}
	counts.served++
	counts.maxLatency = max(counts.maxLatency, time.Since(start))
}

func probeOnce(ctx context.Context, socket, name string) error {
	c, k, err := dialCache(ctx, socket, name, 4)
	if err != nil {
		return err
	}
	defer k.close()
	defer c.Close()
	key := [][]byte{[]byte(name)}
	res, err := k.store(ctx, key)
	if err != nil {
		return err
	}
	if err := res.Err(); err != nil {
		return err
	}
	r, err := k.load(ctx, key)
	if err != nil {
		return err
	}
	if !r.match[0] {
		return fmt.Errorf("load after store: %v (%s)", r.outcomes[0], r.message)
	}
	return nil
}

// rawConn dials socket without the client package.
func rawConn(socket string) (*net.UnixConn, error) {
	c, err := net.DialTimeout("unix", socket, 5*time.Second)
	if err != nil {
		return nil, err
	}
	return c.(*net.UnixConn), nil
}

// hello performs the handshake on a raw connection.
func hello(c *net.UnixConn, name string) error {
	if _, err := c.Write(protocol.AppendFrame(nil, 1, &protocol.Hello{Version: protocol.Version, Client: name})); err != nil {
		return err
	}
	m, err := readFrame(c, 5*time.Second)
	if err != nil {
		return err
	}
	if _, ok := m.(*protocol.Welcome); !ok {
		return fmt.Errorf("hello answered with %T: %v", m, m)
	}
	return nil
}

// readFrame reads one frame within timeout.
func readFrame(c *net.UnixConn, timeout time.Duration) (protocol.Message, error) {
	c.SetReadDeadline(time.Now().Add(timeout))
	defer c.SetReadDeadline(time.Time{})
	var hdr [protocol.HeaderSize]byte
	if _, err := io.ReadFull(c, hdr[:]); err != nil {
		return nil, err
	}
	h, err := protocol.ParseHeader(hdr[:], 1<<30)
	if err != nil {
		return nil, err
	}
	body := make([]byte, h.Len)
	if _, err := io.ReadFull(c, body); err != nil {
		return nil, err
	}
	return protocol.Decode(h.Type, body)
}

// closedWithin reports whether the daemon closes c within timeout: every
// read until then returns frames (error replies) or EOF.
func closedWithin(c *net.UnixConn, timeout time.Duration) bool {
	c.SetReadDeadline(time.Now().Add(timeout))
	buf := make([]byte, 4096)
	for {
		if _, err := c.Read(buf); err != nil {
			var ne net.Error
			return !(errors.As(err, &ne) && ne.Timeout())
		}
	}
}

// holdAll closes conns at the end of the test.
func holdAll(t *testing.T, conns []*net.UnixConn) {
	t.Cleanup(func() {
		for _, c := range conns {
			c.Close()
		}
	})
}

// hostileDaemon starts a daemon with the default server limits.
func hostileDaemon(t *testing.T) *daemon {
	base := testsock.Dir(t)
	return startDaemon(t, daemonConfig{Socket: filepath.Join(base, "run", "kvhost.sock"), Mount: filepath.Join(base, "cache"), Capacity: "1GiB"})
}

// TestHostileClients runs one hostile behaviour per subtest against a
// daemon with the default limits (64 clients), and checks that a new,
// well-behaved client is served within serveDeadline while the hostile
// connections are still open, and that the daemon stays up.
func TestHostileClients(t *testing.T) {
	rng := rand.New(rand.NewPCG(seed(t), 3))
	const crowd = 70 // more than the default max_clients
	cases := []struct {
		name string
		// run does the hostile part, appending the connections it keeps
		// open and counting them.
		run func(t *testing.T, d *daemon, counts *hostileCounts)
	}{
		{"silent connections never say hello", func(t *testing.T, d *daemon, counts *hostileCounts) {
			var conns []*net.UnixConn
			for range crowd {
				c, err := rawConn(d.cfg.Socket)
				if err != nil {
					t.Fatal(err)
				}
				conns = append(conns, c)
				counts.hostile++
			}
			holdAll(t, conns)
		}},
		{"half-sent hello", func(t *testing.T, d *daemon, counts *hostileCounts) {
			frame := protocol.AppendFrame(nil, 1, &protocol.Hello{Version: protocol.Version, Client: "half"})
			var conns []*net.UnixConn
			for range crowd {
				c, err := rawConn(d.cfg.Socket)
				if err != nil {
					t.Fatal(err)
				}
				c.Write(frame[:protocol.HeaderSize+3])
				conns = append(conns, c)
				counts.hostile++
			}
			holdAll(t, conns)
		}},
		{"half-sent frame after hello", func(t *testing.T, d *daemon, counts *hostileCounts) {
			var conns []*net.UnixConn
			for i := range crowd {
				c, err := rawConn(d.cfg.Socket)
				if err != nil {
					t.Fatal(err)
				}
				conns = append(conns, c)
				counts.hostile++
				if hello(c, fmt.Sprintf("half-%d", i)) != nil {
					continue // refused: the daemon is full
				}
				hdr := make([]byte, protocol.HeaderSize)
				binary.LittleEndian.PutUint32(hdr[0:], 1000)
				binary.LittleEndian.PutUint16(hdr[4:], uint16(protocol.TypeLookup))
				binary.LittleEndian.PutUint64(hdr[8:], 2)
				c.Write(append(hdr, make([]byte, 100)...))
			}
			holdAll(t, conns)
		}},
		{"garbage frames", func(t *testing.T, d *daemon, counts *hostileCounts) {
			var mu sync.Mutex
			var wg sync.WaitGroup
			for w := range 8 {
				wrng := rand.New(rand.NewPCG(rng.Uint64(), uint64(w)))
				wg.Add(1)
				go func() {
					defer wg.Done()
					for i := range 25 {
						c, err := rawConn(d.cfg.Socket)
						if err != nil {
							t.Error(err)
							return
						}
						// Half of them after a valid handshake.
						if i%2 == 1 && hello(c, "garbage") != nil {
							c.Close()
							continue
						}
						junk := make([]byte, 16+wrng.IntN(4096))
						for j := range junk {
							junk[j] = byte(wrng.Uint32())
						}
						c.Write(junk)
						closed := closedWithin(c, serveDeadline)
						c.Close()
						mu.Lock()
						counts.hostile++
						if closed {
							counts.closed++
						}
						mu.Unlock()
					}
				}()
			}
			wg.Wait()
			if counts.closed != counts.hostile {
				t.Errorf("the daemon left %d of %d garbage connections open for %v", counts.hostile-counts.closed, counts.hostile, serveDeadline)
			}
		}},
		{"clients exit mid-job", func(t *testing.T, d *daemon, counts *hostileCounts) {
			ctx := context.Background()
			for i := range 16 {
				c, k, err := dialCache(ctx, d.cfg.Socket, fmt.Sprintf("exit-%d", i), 128)
				if err != nil {
					t.Fatal(err)
				}
				counts.hostile++
				var keys [][]byte
				var blocks [][]uint32
				for j := range 64 {
					keys = append(keys, fmt.Appendf(nil, "exit-%d-%d", i, j))
					k.put(j, keys[j])
					blocks = append(blocks, k.blocks(j))
				}
				if _, err := c.Store(ctx, k.id, keys, blocks); err != nil {
					t.Fatal(err)
				}
				c.Close() // without waiting: the daemon cancels the job
				k.close()
			}
			sc, err := client.Dial(ctx, d.cfg.Socket, "stats")
			if err != nil {
				t.Fatal(err)
			}
			defer sc.Close()
			released := waitFor(ctx, serveDeadline, 20*time.Millisecond, func() bool {
				st, err := sc.Stats(ctx)
				return err == nil && st.Clients == 1 && st.InflightJobs == 0
			})
			if !released {
				st, _ := sc.Stats(ctx)
				t.Errorf("%d clients, %d jobs still in the daemon %v after their clients exited", st.Clients, st.InflightJobs, serveDeadline)
			}
			if !waitFor(ctx, serveDeadline, 20*time.Millisecond, func() bool { return len(tempFiles(d.cfg.Mount)) == 0 }) {
				t.Errorf("temporary files left by cancelled jobs: %v", tempFiles(d.cfg.Mount))
			}
			counts.closed = counts.hostile
		}},
		{"unsealed and truncated memfds", func(t *testing.T, d *daemon, counts *hostileCounts) {
			// An unsealed memfd sent by hand is refused.
			c, err := rawConn(d.cfg.Socket)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			counts.hostile++
			if err := hello(c, "unsealed"); err != nil {
				t.Fatal(err)
			}
			fd, err := unix.MemfdCreate("unsealed", unix.MFD_CLOEXEC)
			if err != nil {
				t.Fatal(err)
			}
			defer unix.Close(fd)
			if err := unix.Ftruncate(fd, 1<<20); err != nil {
				t.Fatal(err)
			}
			frame := protocol.AppendFrame(nil, 2, &protocol.RegisterMemory{Kind: protocol.MemoryMemfd, Size: 1 << 20})
			if _, _, err := c.WriteMsgUnix(frame, unix.UnixRights(fd), nil); err != nil {
				t.Fatal(err)
			}
			m, err := readFrame(c, serveDeadline)
			if e, ok := m.(*protocol.Error); err != nil || !ok || e.Code != protocol.CodeBadFd {
				t.Errorf("registration of an unsealed memfd: %v, %v; want a %v error", m, err, protocol.CodeBadFd)
			}
			// A registered (sealed) memfd cannot shrink under a job; growing
			// it changes nothing for the daemon.
			ctx := context.Background()
			cl, k, err := dialCache(ctx, d.cfg.Socket, "truncate", 128)
			if err != nil {
				t.Fatal(err)
			}
			counts.hostile++
			var keys [][]byte
			var blocks [][]uint32
			for j := range 64 {
				keys = append(keys, fmt.Appendf(nil, "trunc-%d", j))
				k.put(j, keys[j])
				blocks = append(blocks, k.blocks(j))
			}
			job, err := cl.Store(ctx, k.id, keys, blocks)
			if err != nil {
				t.Fatal(err)
			}
			if err := unix.Ftruncate(k.mem.Fd(), 0); !errors.Is(err, unix.EPERM) {
				t.Errorf("shrinking a registered memfd: %v, want EPERM (F_SEAL_SHRINK)", err)
			}
			if err := unix.Ftruncate(k.mem.Fd(), 2*k.mem.Len()); err != nil {
				t.Errorf("growing a registered memfd: %v", err)
			}
			if res, err := job.Wait(ctx); err != nil || res.Err() != nil {
				t.Errorf("store from a grown memfd: %v, %v", err, res.Err())
			}
			cl.Close()
			k.close()
		}},
		{"sparse memfds the size of RAM", func(t *testing.T, d *daemon, counts *hostileCounts) {
			var si unix.Sysinfo_t
			if err := unix.Sysinfo(&si); err != nil {
				t.Fatal(err)
			}
			ram := int64(si.Totalram) * int64(si.Unit)
			ctx := context.Background()
			for i := range 3 {
				c, err := client.Dial(ctx, d.cfg.Socket, fmt.Sprintf("sparse-%d", i))
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { c.Close() })
				counts.hostile++
				fd, err := unix.MemfdCreate("sparse", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { unix.Close(fd) })
				if err := unix.Ftruncate(fd, ram); err != nil {
					t.Fatal(err)
				}
				if _, err := c.RegisterFd(ctx, fd, ram); err != nil {
					t.Logf("sparse registration %d of %d bytes refused: %v", i, ram, err)
				}
			}
		}},
		{"throwaway namespaces", func(t *testing.T, d *daemon, counts *hostileCounts) {
			ctx := context.Background()
			for i := range 20 {
				c, err := client.Dial(ctx, d.cfg.Socket, fmt.Sprintf("junk-%d", i))
				if err != nil {
					t.Fatal(err)
				}
				counts.hostile++
				for j := range 60 {
					g := geometry
					g.Model = fmt.Sprintf("junk-%d-%d", i, j)
					if _, err := c.Declare(ctx, g); err != nil {
						t.Logf("throwaway declaration %d/%d refused: %v", i, j, err)
						break
					}
				}
				c.Close()
				counts.closed++
			}
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			d := hostileDaemon(t)
			counts := &hostileCounts{name: tc.name}
			tc.run(t, d, counts)
			for i := 0; i < 2 && counts.notServed == 0; i++ {
				probe(t, d.cfg.Socket, i, counts)
			}
			if !d.alive() {
				t.Errorf("the daemon exited: %v; log:\n%s", d.err, d.log.tail(4000))
			}
			t.Log(counts.String())
			fmt.Println(counts.String())
		})
	}
}
