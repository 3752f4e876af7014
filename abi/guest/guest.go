// Package guest is the Go SDK for kvhost policy plugins.
//
// A plugin author implements Policy (and, optionally, Namespacer, Admitter,
// the tiering interfaces and Ranker) in an ordinary Go package, registers it
// from a main package, and builds it with
//
//	GOOS=wasip1 GOARCH=wasm go build -buildmode=c-shared -o policy.wasm ./cmd/policy
//
// The same Policy compiles natively too: a Dispatcher drives it over a scratch
// buffer exactly as the wasm exports do, so plugin logic is unit-tested with
// plain `go test`, and kvhost uses that path for its native fallback policy.
//
// Records are views into the scratch area (see abi.View): reading or writing a
// record allocates nothing.
package guest

import (
	"errors"

	"github.com/kvhost/kvhost/abi"
)

// Policy is a placement policy: naming, access tracking and eviction.
type Policy interface {
	// Init receives the plugin's configuration. It is called once, before any
	// other hook.
	Init(cfg Config) error
	// Name fills Mount and Path of every record.
	Name(recs []abi.NameRecord) error
	// Access records events on stored entries.
	Access(recs []abi.AccessRecord) error
	// Evict writes victims for req into out, at most len(out), and returns how
	// many it wrote. It must never return a pinned entry.
	Evict(req *abi.EvictRequest, out []abi.Victim) (int, error)
}

// Namespacer is implemented by policies that choose a chunk layout per
// namespace (abi.FeatureNamespace).
type Namespacer interface {
	// Namespace sets r.KeysPerFile and r.Order for the namespace r
	// describes. The host fills in the default layout (1 key per file,
	// layer-major) before the call: a policy that leaves them chooses it.
	Namespace(r *abi.NamespaceRecord) error
}

// Admitter is implemented by policies that may decline stores (abi.FeatureAdmit).
type Admitter interface {
	// Admit sets Admit to 1 (store) or 0 (skip) in every record.
	Admit(recs []abi.AdmitRecord) error
}

// MountWatcher is implemented by policies that want the description of
// every mount (abi.FeatureMounts): capacity, usage, device class, file
// system. Mounts is called after Init and whenever a description changes.
type MountWatcher interface {
	// Mounts receives one record per mount, in index order.
	Mounts(recs []abi.MountRecord) error
}

// Demoter is implemented by policies whose eviction may move a victim to
// another mount instead of deleting it (abi.FeatureDemote). The Dispatcher
// calls EvictTo instead of Policy.Evict.
type Demoter interface {
	// EvictTo is Policy.Evict with, for each victim out[i] written, its
	// target in targets[i]: prefilled with abi.NoMount (delete); a mount
	// index moves the file there.
	EvictTo(req *abi.EvictRequest, out []abi.Victim, targets []abi.VictimTarget) (int, error)
}

// Ticker is implemented by policies that want periodic calls
// (abi.FeatureTick), for ageing and background moves.
type Ticker interface {
	// Tick writes up to len(out) moves and returns how many it wrote.
	Tick(req *abi.TickRequest, out []abi.Move) (int, error)
}

// Ranker is implemented by policies that rank entries for a bound shared
// by several nodes (abi.FeatureRank): Rank writes Rank and State of every
// record. A rank must depend only on the entry's access history and the
// record's Time, so that two nodes running the same policy and
// configuration rank alike (docs/abi.md, "RankRecord").
type Ranker interface {
	// Rank writes Rank and State of every record in recs.
	Rank(recs []abi.RankRecord) error
}

// Featurer lets a policy declare feature bits that need no hook of their
// own: abi.FeatureAdmitMount (its Admit writes AdmitRecord.Target). Other
// bits it returns are ignored: those come from the interfaces implemented.
type Featurer interface {
	// ExtraFeatures returns the extra feature bits; only
	// abi.FeatureAdmitMount is kept.
	ExtraFeatures() abi.Feature
}

// StatusError is an error that maps to a specific abi.Status. Errors that are
// not StatusErrors are reported as abi.StatusInternal.
type StatusError struct {
	// Status is the status the hook returns; one that is not negative is
	// reported as abi.StatusInternal.
	Status abi.Status
	// Msg says what went wrong; Error prefixes it with Status.
	Msg string
}

// Error is the status followed by the message.
func (e *StatusError) Error() string { return e.Status.String() + ": " + e.Msg }

// Errorf-free helpers for the common statuses.

// InvalidInput returns a StatusError with abi.StatusInvalidInput.
func InvalidInput(msg string) error { return &StatusError{Status: abi.StatusInvalidInput, Msg: msg} }

// Unsupported returns a StatusError with abi.StatusUnsupported.
func Unsupported(msg string) error { return &StatusError{Status: abi.StatusUnsupported, Msg: msg} }

// Features returns the feature bits p implements.
func Features(p Policy) abi.Feature {
	var f abi.Feature
	if _, ok := p.(Namespacer); ok {
		f |= abi.FeatureNamespace
	}
	if _, ok := p.(Admitter); ok {
		f |= abi.FeatureAdmit
		if fe, ok := p.(Featurer); ok {
			f |= fe.ExtraFeatures() & abi.FeatureAdmitMount
		}
	}
	if _, ok := p.(MountWatcher); ok {
		f |= abi.FeatureMounts
	}
	if _, ok := p.(Demoter); ok {
		f |= abi.FeatureDemote
	}
	if _, ok := p.(Ticker); ok {
		f |= abi.FeatureTick
	}
	if _, ok := p.(Ranker); ok {
		f |= abi.FeatureRank
	}
	return f
}

// Dispatcher runs a Policy over a scratch area, decoding the ABI calls the
// host makes. The wasm exports of this package use one; the host's native
// fallback uses another. A Dispatcher is not safe for concurrent use.
type Dispatcher struct {
	p       Policy
	ns      Namespacer
	adm     Admitter
	mw      MountWatcher
	dem     Demoter
	tick    Ticker
	rank    Ranker
	scratch []byte
	// Log, if set, receives the message of every error a hook returns.
	Log func(level int32, msg string)
}

// NewDispatcher returns a Dispatcher for p.
func NewDispatcher(p Policy) *Dispatcher {
	d := &Dispatcher{p: p}
	d.ns, _ = p.(Namespacer)
	d.adm, _ = p.(Admitter)
	d.mw, _ = p.(MountWatcher)
	d.dem, _ = p.(Demoter)
	d.tick, _ = p.(Ticker)
	d.rank, _ = p.(Ranker)
	return d
}

// Features implements kvhost_features.
func (d *Dispatcher) Features() abi.Feature { return Features(d.p) }

// Scratch implements kvhost_scratch: it returns a scratch area of at least n
// bytes, aligned to abi.ScratchAlign, reusing the current one if it is big
// enough. It returns nil for a negative n.
func (d *Dispatcher) Scratch(n int) []byte {
	if n < 0 {
		return nil
	}
	if n > len(d.scratch) {
		d.scratch = abi.AlignedBuffer(n)
	}
	return d.scratch
}

// Init implements kvhost_init: the configuration is in the first n bytes of
// the scratch area.
func (d *Dispatcher) Init(n int32) int32 {
	if n < 0 || int(n) > len(d.scratch) || n > abi.MaxConfigLen {
		return int32(abi.StatusInvalidInput)
	}
	cfg, err := ParseConfig(d.scratch[:n])
	if err != nil {
		return d.fail(err)
	}
	return d.fail(d.p.Init(cfg))
}

// Namespace implements kvhost_namespace.
func (d *Dispatcher) Namespace() int32 {
	if d.ns == nil {
		return int32(abi.StatusUnsupported)
	}
	recs, st := view[abi.NamespaceRecord](d.scratch, 0, 1)
	if st != abi.StatusOK {
		return int32(st)
	}
	return d.fail(d.ns.Namespace(&recs[0]))
}

// Name implements kvhost_name.
func (d *Dispatcher) Name(n int32) int32 {
	recs, st := view[abi.NameRecord](d.scratch, 0, n)
	if st != abi.StatusOK {
		return int32(st)
	}
	return d.fail(d.p.Name(recs))
}

// Admit implements kvhost_admit.
func (d *Dispatcher) Admit(n int32) int32 {
	if d.adm == nil {
		return int32(abi.StatusUnsupported)
	}
	recs, st := view[abi.AdmitRecord](d.scratch, 0, n)
	if st != abi.StatusOK {
		return int32(st)
	}
	return d.fail(d.adm.Admit(recs))
}

// Access implements kvhost_access.
func (d *Dispatcher) Access(n int32) int32 {
	recs, st := view[abi.AccessRecord](d.scratch, 0, n)
	if st != abi.StatusOK {
		return int32(st)
	}
	return d.fail(d.p.Access(recs))
}

// Evict implements kvhost_evict: the request is at offset 0, room for max
// victims follows it.
func (d *Dispatcher) Evict(max int32) int32 {
	req, st := view[abi.EvictRequest](d.scratch, 0, 1)
	if st != abi.StatusOK {
		return int32(st)
	}
	out, st := view[abi.Victim](d.scratch, abi.EvictHeaderSize, max)
	if st != abi.StatusOK {
		return int32(st)
	}
	var n int
	var err error
	if d.dem != nil {
		targets, st := view[abi.VictimTarget](d.scratch, abi.EvictTargetsOffset, max)
		if st != abi.StatusOK {
			return int32(st)
		}
		n, err = d.dem.EvictTo(&req[0], out, targets)
	} else {
		n, err = d.p.Evict(&req[0], out)
	}
	if err != nil {
		return d.fail(err)
	}
	if n < 0 || n > len(out) {
		return d.fail(&StatusError{Status: abi.StatusInternal, Msg: "Evict returned a count outside its output"})
	}
	return int32(n)
}

// Mounts implements kvhost_mounts.
func (d *Dispatcher) Mounts(n int32) int32 {
	if d.mw == nil {
		return int32(abi.StatusUnsupported)
	}
	recs, st := view[abi.MountRecord](d.scratch, 0, n)
	if st != abi.StatusOK {
		return int32(st)
	}
	return d.fail(d.mw.Mounts(recs))
}

// Tick implements kvhost_tick: the request is at offset 0, room for max
// moves follows it.
func (d *Dispatcher) Tick(max int32) int32 {
	if d.tick == nil {
		return int32(abi.StatusUnsupported)
	}
	req, st := view[abi.TickRequest](d.scratch, 0, 1)
	if st != abi.StatusOK {
		return int32(st)
	}
	out, st := view[abi.Move](d.scratch, abi.TickHeaderSize, max)
	if st != abi.StatusOK {
		return int32(st)
	}
	n, err := d.tick.Tick(&req[0], out)
	if err != nil {
		return d.fail(err)
	}
	if n < 0 || n > len(out) {
		return d.fail(&StatusError{Status: abi.StatusInternal, Msg: "Tick returned a count outside its output"})
	}
	return int32(n)
}

// Rank implements kvhost_rank.
func (d *Dispatcher) Rank(n int32) int32 {
	if d.rank == nil {
		return int32(abi.StatusUnsupported)
	}
	recs, st := view[abi.RankRecord](d.scratch, 0, n)
	if st != abi.StatusOK {
		return int32(st)
	}
	return d.fail(d.rank.Rank(recs))
}

func (d *Dispatcher) fail(err error) int32 {
	if err == nil {
		return int32(abi.StatusOK)
	}
	if d.Log != nil {
		d.Log(8, err.Error())
	}
	var se *StatusError
	if errors.As(err, &se) && se.Status < 0 {
		return int32(se.Status)
	}
	return int32(abi.StatusInternal)
}

func view[T abi.Record](scratch []byte, off int, n int32) ([]T, abi.Status) {
	size := abi.SizeOf[T]()
	if n < 0 || n > abi.MaxBatch || off+int(n)*size > len(scratch) {
		return nil, abi.StatusInvalidInput
	}
	return abi.View[T](scratch[off:], int(n)), abi.StatusOK
}
