package transfer

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/fsys"
)

// fakeMover answers with a fixed result and counts its calls.
type fakeMover struct {
	name     string
	sums     bool
	n        int64
	err      error
	calls    int
	forgets  int
	writeArg *Plan
}

func (m *fakeMover) Name() string    { return m.name }
func (m *fakeMover) Checksums() bool { return m.sums }
func (m *fakeMover) WriteFile(_ context.Context, _ fsys.File, p *Plan, _ []uint32) (int64, error) {
	m.calls++
	m.writeArg = p
	return m.n, m.err
}
func (m *fakeMover) ReadFile(_ context.Context, _ fsys.File, p *Plan, _ []uint32) (int64, error) {
	m.calls++
	return m.n, m.err
}
func (m *fakeMover) Forget(fsys.FileID) { m.forgets++ }

func TestChain(t *testing.T) {
	unsupported := fmt.Errorf("cufile: mount unusable: %w", ErrUnsupported)
	failed := errors.New("cufile: read failed (EIO)")
	cases := []struct {
		name      string
		first     *fakeMover
		second    *fakeMover
		wantN     int64
		wantErr   error
		wantCalls [2]int
		wantLogs  int
	}{
		{"first serves", &fakeMover{name: "a", n: 10}, &fakeMover{name: "b", n: 20}, 10, nil, [2]int{1, 0}, 0},
		{"unsupported falls back and is logged once", &fakeMover{name: "a", err: unsupported}, &fakeMover{name: "b", n: 20}, 20, nil, [2]int{1, 1}, 1},
		{"a failure never falls back", &fakeMover{name: "a", err: failed}, &fakeMover{name: "b", n: 20}, 0, failed, [2]int{1, 0}, 0},
		{"unsupported after moving bytes is a failure", &fakeMover{name: "a", n: 5, err: unsupported}, &fakeMover{name: "b", n: 20}, 5, ErrUnsupported, [2]int{1, 0}, 0},
		{"every mover unsupported", &fakeMover{name: "a", err: unsupported}, &fakeMover{name: "b", err: unsupported}, 0, ErrUnsupported, [2]int{1, 1}, 1},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var logs bytes.Buffer
			ch, err := NewChain("/mnt/x", slog.New(slog.NewTextHandler(&logs, nil)), c.first, c.second)
			if err != nil {
				t.Fatal(err)
			}
			for range 2 { // twice: the fallback is logged once, counted twice
				n, err := ch.WriteFile(context.Background(), nil, &Plan{}, nil)
				if n != c.wantN || (c.wantErr == nil) != (err == nil) || (c.wantErr != nil && !errors.Is(err, c.wantErr)) {
					t.Fatalf("WriteFile = %d, %v; want %d, %v", n, err, c.wantN, c.wantErr)
				}
			}
			if c.first.calls != 2*c.wantCalls[0] || c.second.calls != 2*c.wantCalls[1] {
				t.Errorf("calls = %d, %d; want %d, %d", c.first.calls, c.second.calls, 2*c.wantCalls[0], 2*c.wantCalls[1])
			}
			if got := strings.Count(logs.String(), "data path falls back"); got != c.wantLogs {
				t.Errorf("%d fallback log lines, want %d:\n%s", got, c.wantLogs, logs.String())
			}
			if c.wantLogs > 0 {
				if fb := ch.Fallbacks()["a"]; fb != 2 {
					t.Errorf("fallbacks of a = %d, want 2", fb)
				}
				if !strings.Contains(logs.String(), "mount unusable") {
					t.Errorf("the log line does not carry the reason:\n%s", logs.String())
				}
			}
		})
	}
}

func TestChainChecksumsOnlyIfEveryMoverDoes(t *testing.T) {
	a, b := &fakeMover{name: "a", sums: true}, &fakeMover{name: "b", sums: false}
	ch, _ := NewChain("m", nil, a, b)
	if ch.Checksums() {
		t.Fatal("a chain with a mover that cannot checksum claims checksums")
	}
	b.sums = true
	if !ch.Checksums() {
		t.Fatal("a chain of checksumming movers does not checksum")
	}
	if ch.Name() != "a→b" {
		t.Errorf("Name = %q", ch.Name())
	}
}

// writtenMover is a fakeMover that says whether its write checksums are
// of the bytes written.
type writtenMover struct {
	fakeMover
	written bool
}

func (m *writtenMover) SumsWritten() bool { return m.written }

func TestChainSumsWrittenOnlyIfEveryMoverSaysSo(t *testing.T) {
	for _, tc := range []struct {
		name   string
		movers []Mover
		want   bool
	}{
		{"every mover's sums are of the bytes written", []Mover{&writtenMover{written: true}, &writtenMover{written: true}}, true},
		{"one mover's are not", []Mover{&writtenMover{written: true}, &writtenMover{written: false}}, false},
		{"one mover does not say", []Mover{&writtenMover{written: true}, &fakeMover{sums: true}}, false},
	} {
		ch, err := NewChain("m", nil, tc.movers...)
		if err != nil {
			t.Fatal(err)
		}
		if got := SumsWritten(ch); got != tc.want {
			t.Errorf("%s: SumsWritten = %v, want %v", tc.name, got, tc.want)
		}
	}
	if SumsWritten(&fakeMover{sums: true}) {
		t.Error("a mover that does not implement WrittenSummer counts as summing the bytes written")
	}
}

func TestChainForgetReachesEveryMover(t *testing.T) {
	a, b := &fakeMover{name: "a"}, &fakeMover{name: "b"}
	ch, _ := NewChain("m", nil, a, b)
	ch.Forget(fsys.FileID{Dev: 1, Ino: 2})
	if a.forgets != 1 || b.forgets != 1 {
		t.Fatalf("forgets = %d, %d", a.forgets, b.forgets)
	}
}

func TestNewChainRejectsEmptyAndNil(t *testing.T) {
	if _, err := NewChain("m", nil); err == nil {
		t.Error("empty chain accepted")
	}
	if _, err := NewChain("m", nil, &fakeMover{name: "a"}, nil); err == nil {
		t.Error("nil mover accepted")
	}
}

// TestChainCountsOnlyPlansPassedOn: a fallback is a plan a mover passed on
// to the next one; the last mover's ErrUnsupported has nowhere to go and
// fails the call, so it is not counted as one (docs/gds.md, "The
// fallback chain"; kvhost_data_path_fallbacks_total).
func TestChainCountsOnlyPlansPassedOn(t *testing.T) {
	unsupported := fmt.Errorf("gpu: device 3 is not served: %w", ErrUnsupported)
	a, b := &fakeMover{name: "a", err: unsupported}, &fakeMover{name: "b", err: unsupported}
	ch, _ := NewChain("m", nil, a, b)
	if _, err := ch.ReadFile(context.Background(), nil, &Plan{}, nil); !errors.Is(err, ErrUnsupported) {
		t.Fatalf("ReadFile = %v, want ErrUnsupported", err)
	}
	if got, want := ch.Fallbacks(), map[string]uint64{"a": 1, "b": 0}; !maps.Equal(got, want) {
		t.Fatalf("Fallbacks = %v, want %v", got, want)
	}
}
