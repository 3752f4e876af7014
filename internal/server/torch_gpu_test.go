package server_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/kvhost/kvhost/cuda"
	"github.com/kvhost/kvhost/internal/server"
	"github.com/kvhost/kvhost/internal/server/cudaipc"
)

// TestGPUTorchRegistration is the GPU check of CUDA IPC registration: a
// torch process registers a CUDA tensor with a daemon that imports it
// through the real CUDA runtime; the daemon reads the imported memory and
// finds the tensor's bytes; bad handles and ranges get clear errors; the
// imports are closed when the client unregisters, and when a client exits
// without doing so. It needs a GPU and torch: run the test binary with
// KVHOST_GPU=1 (KVHOST_TORCH_SCRIPT and KVHOST_PYTHONPATH locate the
// script and the Python client when the binary runs elsewhere).
func TestGPUTorchRegistration(t *testing.T) {
	if os.Getenv("KVHOST_GPU") != "1" {
		t.Skip("GPU check: set KVHOST_GPU=1 on a machine with a GPU and torch")
	}
	rt, err := cuda.Open(cuda.Config{})
	if err != nil {
		t.Fatalf("KVHOST_GPU=1 but no CUDA runtime: %v", err)
	}
	t.Cleanup(func() { rt.Close() })
	im, err := cudaipc.New(rt, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { im.Close() })
	var mu sync.Mutex
	var imported []server.DeviceMemory
	open := func(ctx context.Context, d int, h [64]byte, off, size int64) (server.DeviceMemory, error) {
		m, err := im.Open(ctx, d, h, off, size)
		if err == nil {
			mu.Lock()
			imported = append(imported, m)
			mu.Unlock()
		}
		return m, err
	}
	f := newFixture(t, server.Config{OpenDevice: open, Devices: im.Devices()})
	script := envOr("KVHOST_TORCH_SCRIPT", "testdata/torch_ipc.py")
	pypath, err := filepath.Abs(envOr("KVHOST_PYTHONPATH", "../../client/python/src"))
	if err != nil {
		t.Fatal(err)
	}
	w, err := rt.NewWorker(0)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	for _, mode := range []string{"checks", "exit"} {
		t.Run(mode, func(t *testing.T) {
			mu.Lock()
			imported = nil
			mu.Unlock()
			cmd := exec.Command("python3", script, f.socket, mode)
			cmd.Env = append(os.Environ(), "PYTHONPATH="+pypath)
			stdin, _ := cmd.StdinPipe()
			stdout, _ := cmd.StdoutPipe()
			var stderr strings.Builder
			cmd.Stderr = &stderr
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			defer cmd.Process.Kill() // a failed check must not leave it registered
			rd := bufio.NewReader(stdout)
			line, err := rd.ReadString('\n')
			if err != nil || !strings.HasPrefix(line, "READY ") {
				cmd.Wait()
				t.Fatalf("torch process: %q %v\n%s", line, err, stderr.String())
			}
			t.Log(strings.TrimSpace(line))
			var rid, size, filled int64
			if _, err := fmt.Sscanf(line, "READY %d %d %d", &rid, &size, &filled); err != nil || filled > size {
				t.Fatalf("torch process said %q: %v", line, err)
			}
			mu.Lock()
			if len(imported) != 1 || imported[0].Len() != size {
				mu.Unlock()
				t.Fatalf("%d imports, want one of %d bytes", len(imported), size)
			}
			m := imported[0]
			mu.Unlock()
			// Read the imported memory as the daemon's GPU path would see it.
			got := make([]byte, size)
			if err := w.Do(context.Background(), func(w *cuda.Worker) error {
				p, err := rt.HostAlloc(int(size))
				if err != nil {
					return err
				}
				defer p.Free()
				if err := rt.CopySync(p.Ptr(), m.Ptr(), uintptr(size)); err != nil {
					return err
				}
				copy(got, p.Bytes())
				return nil
			}); err != nil {
				t.Fatalf("reading the imported memory: %v", err)
			}
			for i, b := range got[:filled] {
				if want := byte((int64(i)*7 + 3) % 251); b != want {
					t.Fatalf("imported byte %d = %d, want %d (the tensor's)", i, b, want)
				}
			}
			io.WriteString(stdin, "go\n")
			rest, _ := io.ReadAll(rd)
			if err := cmd.Wait(); err != nil {
				t.Fatalf("torch process: %v\n%s%s", err, rest, stderr.String())
			}
			t.Logf("%s", rest)
			if err := f.srv.WaitSessions(context.Background(), 0); err != nil {
				t.Fatal(err)
			}
			if im.Live() != 0 {
				t.Fatalf("%d imports still open after the client is gone", im.Live())
			}
		})
	}
}

func envOr(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}
