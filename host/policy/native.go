package policy

import (
	"context"
	"fmt"
	"log/slog"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/abi/guest"
)

// nativeBackend runs a Go policy in process, through the guest SDK's
// Dispatcher: the same scratch layout as a wasm instance, so the host's ops,
// validation and rebuilding are shared.
type nativeBackend struct {
	newPolicy func() guest.Policy
	feats     abi.Feature
	log       *slog.Logger
}

func newNativeBackend(newPolicy func() guest.Policy, name string, log *slog.Logger) *nativeBackend {
	return &nativeBackend{newPolicy: newPolicy, feats: guest.Features(newPolicy()), log: log.With("native", name)}
}

func (b *nativeBackend) kind() string                    { return "native" }
func (b *nativeBackend) features() abi.Feature           { return b.feats }
func (b *nativeBackend) close(ctx context.Context) error { return nil }

func (b *nativeBackend) newInstance(_ context.Context, shard int) (inst instance, err error) {
	defer func() {
		if r := recover(); r != nil {
			inst, err = nil, fmt.Errorf("panic: %v", r)
		}
	}()
	p := b.newPolicy()
	if p == nil {
		return nil, fmt.Errorf("the native policy constructor returned nil")
	}
	if f := guest.Features(p); f != b.feats {
		return nil, fmt.Errorf("features %s differ from the first instance's %s", f, b.feats)
	}
	d := guest.NewDispatcher(p)
	log := b.log.With("shard", shard)
	in := &nativeInstance{d: d, buf: d.Scratch(scratchSize)}
	d.Log = func(level int32, msg string) {
		log.Log(context.Background(), slog.Level(level), msg)
		if slog.Level(level) >= slog.LevelWarn {
			in.last = msg
		}
	}
	return in, nil
}

// nativeInstance is one native policy and its scratch area.
type nativeInstance struct {
	d    *guest.Dispatcher
	buf  []byte
	last string // the last warning or error logged
}

func (in *nativeInstance) lastMessage() string {
	m := in.last
	in.last = ""
	return m
}

func (in *nativeInstance) scratch() []byte       { return in.buf }
func (in *nativeInstance) close(context.Context) {}

// call runs a hook; a panic in the policy is a failure of the instance.
func (in *nativeInstance) call(_ context.Context, h hook, arg int32) (st int32, err error) {
	defer func() {
		if r := recover(); r != nil {
			st, err = 0, fmt.Errorf("panic: %v", r)
		}
	}()
	switch h {
	case hookInit:
		return in.d.Init(arg), nil
	case hookNamespace:
		return in.d.Namespace(), nil
	case hookName:
		return in.d.Name(arg), nil
	case hookAdmit:
		return in.d.Admit(arg), nil
	case hookAccess:
		return in.d.Access(arg), nil
	case hookEvict:
		return in.d.Evict(arg), nil
	case hookMounts:
		return in.d.Mounts(arg), nil
	case hookTick:
		return in.d.Tick(arg), nil
	case hookRank:
		return in.d.Rank(arg), nil
	}
	return 0, fmt.Errorf("unknown hook %d", h)
}
