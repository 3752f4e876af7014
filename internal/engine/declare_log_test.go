//go:build invariants

package engine

import (
	"context"
	"errors"
	"testing"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/abi/guest"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/plugins/lru"
)

// shardLayout is lru with a layout that depends on its shard: a plugin
// whose kvhost_namespace is not deterministic.
type shardLayout struct {
	*lru.Policy
	shard int64
}

func (p *shardLayout) Init(cfg guest.Config) error {
	p.shard, _ = cfg.Int(policy.ParamShard, 0)
	return p.Policy.Init(cfg)
}

func (p *shardLayout) Namespace(r *abi.NamespaceRecord) error {
	r.KeysPerFile, r.Order = uint32(p.shard+1), abi.OrderLayerMajor
	return nil
}

// TestDeclareRefusedByThePolicyIsLogged: a declaration the policy host
// refuses (shards choosing different layouts) fails for the client and is
// logged for the operator (issue 37: nothing in the daemon's log).
func TestDeclareRefusedByThePolicyIsLogged(t *testing.T) {
	log, n := countingLogger(t, "the policy refused a namespace")
	e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir()}}, Logger: log, NewPolicy: func(idx policy.Index) (policy.Policy, error) {
		return policy.NewNative(func() guest.Policy { return &shardLayout{Policy: lru.New()} }, idx, policy.Config{Shards: 2})
	}})
	if _, err := e.Declare(context.Background(), smallGeometry(true)); !errors.Is(err, ErrPolicy) {
		t.Fatalf("Declare: %v, want ErrPolicy (layouts differ per shard)", err)
	}
	if n.Load() != 1 {
		t.Fatalf("the refusal was logged %d times, want once", n.Load())
	}
}
