//go:build invariants

package engine

import (
	"context"
	"math/rand/v2"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/internal/testwait"
)

// promotingPolicy is testPolicy naming every file on mount 1 (a shared
// cluster mount) whose tick promotes every entry it knows on mount 1 to
// mount 0 (a node-local mount), as a tiering policy promotes hot files.
type promotingPolicy struct {
	*testPolicy
}

func (p *promotingPolicy) Features() abi.Feature {
	return p.testPolicy.Features() | abi.FeatureTick
}

func (p *promotingPolicy) Name(ctx context.Context, recs []abi.NameRecord) error {
	err := p.testPolicy.Name(ctx, recs)
	for i := range recs {
		recs[i].Mount = 1
	}
	return err
}

func (p *promotingPolicy) Admit(ctx context.Context, recs []abi.AdmitRecord) error {
	err := p.testPolicy.Admit(ctx, recs)
	for i := range recs {
		recs[i].Target = recs[i].Mount
	}
	return err
}

func (p *promotingPolicy) UpdateMounts(context.Context, []abi.MountRecord) error { return nil }

func (p *promotingPolicy) Evictions(ctx context.Context, req abi.EvictRequest, max int) ([]policy.Eviction, error) {
	vs, err := p.Victims(ctx, req, max)
	out := make([]policy.Eviction, len(vs))
	for i, v := range vs {
		out[i] = policy.Eviction{Victim: v, Target: abi.VictimTarget{Mount: abi.NoMount}}
	}
	return out, err
}

func (p *promotingPolicy) Tick(context.Context, abi.TickRequest, int) ([]abi.Move, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []abi.Move
	for id, e := range p.entries {
		if e.Mount == 1 && p.pins[id] == 0 {
			out = append(out, abi.Move{Entry: id, Mount: 0})
		}
	}
	return out, nil
}

// TestATickMoveLeavesAnotherLiveNodesFileOnAClusterMount: nodes A and B
// share a cluster mount (mount 1), each with a local mount 0. A stores key
// k on the shared mount; B finds it (lookup), and B's policy tick asks to
// promote it to B's local mount. A move removes its source, and a node
// removes only its own files and those of dead nodes it adopted
// (docs/cluster.md): B's move is refused and A's file stays.
func TestATickMoveLeavesAnotherLiveNodesFileOnAClusterMount(t *testing.T) {
	ctx := context.Background()
	shared := t.TempDir()
	open := func(id string, tick time.Duration) *node {
		pol := &promotingPolicy{testPolicy: newTestPolicy(1, abi.OrderLayerMajor)}
		e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir()}, {Path: shared, ClusterCapacity: 1 << 30, ClusterInterval: time.Hour}},
			Policy: pol, NodeID: id, TickInterval: tick})
		g := smallGeometry(true)
		ns, err := e.Declare(ctx, g)
		if err != nil {
			t.Fatal(err)
		}
		return &node{e: e, ns: ns, c: newTestCache(t, e, ns, g, 64, layoutPlaneFirst)}
	}
	a := open("a", -1) // A never ticks
	k := [][]byte{[]byte("shared-key")}
	a.c.fill(rand.New(rand.NewPCG(1, 1)), []int{0, 1, 2, 3})
	storeAndCheck(t, a.e, a.c, k, [][]int{{0, 1, 2, 3}})
	var files []string
	for _, f := range dataFiles(t, shared) {
		if !strings.Contains(f, "/.kvhost-cluster/") {
			files = append(files, f)
		}
	}
	if len(files) != 1 {
		t.Fatalf("files on the shared mount: %v", files)
	}
	aFile := files[0]

	b := open("b", 10*time.Millisecond)
	if n, _ := b.e.Lookup(ctx, b.ns, k); n != 1 {
		t.Fatalf("B does not find A's file: lookup %d", n)
	}
	en := b.e.find(b.e.tables.get(b.ns), k[0])
	if en == nil || b.e.mounts[1].mayEvict(en) {
		t.Fatalf("B may evict A's file (entry %v): want a foreign file", en)
	}
	testwait.Until(t, "20 of B's ticks", testwait.Hang, func() bool { return b.e.TierStats().Ticks >= 20 })
	if _, err := os.Stat(aFile); err != nil {
		t.Fatalf("B's tick move (%d moves) removed live node A's file %s from the cluster mount: %v", b.e.TierStats().Moves, aFile, err)
	}
}
