// Package policytest drives a guest.Policy natively through a
// guest.Dispatcher, exactly as the wasm exports do, for the tests and
// benchmarks of the built-in policies: records are written into the
// dispatcher's scratch area, the hook is called by its ABI entry point, and
// outputs are read back from the scratch area.
package policytest

import (
	"fmt"

	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/abi/guest"
)

// Driver runs one policy instance.
type Driver struct {
	D       *guest.Dispatcher // the dispatcher the policy runs behind
	scratch []byte
}

// ScratchSize fits the largest batch of any hook.
const ScratchSize = abi.MaxBatch*abi.NameRecordSize + abi.EvictHeaderSize

// New returns a Driver for p, initialised with cfg (key, value pairs).
func New(p guest.Policy, cfg ...string) (*Driver, error) {
	d := &Driver{D: guest.NewDispatcher(p)}
	d.scratch = d.D.Scratch(ScratchSize)
	var c guest.Config
	for i := 0; i+1 < len(cfg); i += 2 {
		c.Set(cfg[i], cfg[i+1])
	}
	b := c.Encode()
	copy(d.scratch, b)
	if st := d.D.Init(int32(len(b))); st != 0 {
		return nil, fmt.Errorf("policytest: kvhost_init: %v", abi.Status(st))
	}
	return d, nil
}

// Namespace declares ns and returns the record with the policy's layout.
func (d *Driver) Namespace(ns abi.NamespaceRecord) (abi.NamespaceRecord, error) {
	abi.View[abi.NamespaceRecord](d.scratch, 1)[0] = ns
	if st := d.D.Namespace(); st != 0 {
		return ns, fmt.Errorf("policytest: kvhost_namespace: %v", abi.Status(st))
	}
	return abi.View[abi.NamespaceRecord](d.scratch, 1)[0], nil
}

// NameRecords returns a view of n name records in the scratch area, for
// callers that fill them in place (benchmarks).
func (d *Driver) NameRecords(n int) []abi.NameRecord { return abi.View[abi.NameRecord](d.scratch, n) }

// AccessRecords returns a view of n access records in the scratch area.
func (d *Driver) AccessRecords(n int) []abi.AccessRecord {
	return abi.View[abi.AccessRecord](d.scratch, n)
}

// Name copies recs into the scratch area, calls kvhost_name and copies the
// results back into recs.
func (d *Driver) Name(recs []abi.NameRecord) error {
	copy(d.NameRecords(len(recs)), recs)
	if err := d.NameInPlace(len(recs)); err != nil {
		return err
	}
	copy(recs, d.NameRecords(len(recs)))
	return nil
}

// NameInPlace calls kvhost_name on the n records already in the scratch area.
func (d *Driver) NameInPlace(n int) error {
	if st := d.D.Name(int32(n)); st != 0 {
		return fmt.Errorf("policytest: kvhost_name: %v", abi.Status(st))
	}
	return nil
}

// Access copies recs into the scratch area and calls kvhost_access.
func (d *Driver) Access(recs ...abi.AccessRecord) error {
	copy(d.AccessRecords(len(recs)), recs)
	return d.AccessInPlace(len(recs))
}

// AccessInPlace calls kvhost_access on the n records already in the scratch area.
func (d *Driver) AccessInPlace(n int) error {
	if st := d.D.Access(int32(n)); st != 0 {
		return fmt.Errorf("policytest: kvhost_access: %v", abi.Status(st))
	}
	return nil
}

// Evict calls kvhost_evict for req with room for max victims and returns a
// copy of the victims.
func (d *Driver) Evict(req abi.EvictRequest, max int) ([]abi.Victim, error) {
	n, err := d.EvictInPlace(req, max)
	if err != nil {
		return nil, err
	}
	return append([]abi.Victim(nil), d.Victims(n)...), nil
}

// EvictInPlace calls kvhost_evict and returns the number of victims, which
// Victims views.
func (d *Driver) EvictInPlace(req abi.EvictRequest, max int) (int, error) {
	abi.View[abi.EvictRequest](d.scratch, 1)[0] = req
	st := d.D.Evict(int32(max))
	if st < 0 {
		return 0, fmt.Errorf("policytest: kvhost_evict: %v", abi.Status(st))
	}
	return int(st), nil
}

// Victims views the first n victims of the last eviction.
func (d *Driver) Victims(n int) []abi.Victim {
	return abi.View[abi.Victim](d.scratch[abi.EvictHeaderSize:], n)
}

// Entries returns the ids of victims, for comparisons.
func Entries(vs []abi.Victim) []uint64 {
	ids := make([]uint64, len(vs))
	for i, v := range vs {
		ids[i] = v.Entry
	}
	return ids
}

// Rec is a shorthand for an access record.
func Rec(kind uint32, entry, time, size uint64) abi.AccessRecord {
	return abi.AccessRecord{Kind: kind, Entry: entry, Time: time, Size: size, KeyHash: entry * 0x9E3779B97F4A7C15}
}

// OnMount returns r with Mount set.
func OnMount(r abi.AccessRecord, mount uint32) abi.AccessRecord {
	r.Mount = mount
	return r
}

// Namespace returns a namespace record for tests.
func Namespace(ns uint32, model string, fingerprint uint64, rank, mounts uint32) abi.NamespaceRecord {
	r := abi.NamespaceRecord{NS: ns, Fingerprint: fingerprint, TPRank: rank, TPSize: rank + 1, MountCount: mounts,
		Layers: 32, KVHeads: 8, HeadSize: 128, DtypeSize: 2, TokensPerBlock: 16, TokensPerKey: 256, KeyBytes: 32 << 20}
	r.SetModelID(model)
	return r
}

// NameRec returns a name record for key in namespace ns.
func NameRec(ns abi.NamespaceRecord, key []byte) abi.NameRecord {
	r := abi.NameRecord{NS: ns.NS, Fingerprint: ns.Fingerprint, TPRank: ns.TPRank, MountCount: ns.MountCount}
	r.SetKey(key)
	return r
}

// Targets views the targets of the first n victims of the last eviction
// (abi.FeatureDemote).
func (d *Driver) Targets(n int) []abi.VictimTarget {
	return abi.View[abi.VictimTarget](d.scratch[abi.EvictTargetsOffset:], n)
}

// Mounts copies recs into the scratch area and calls kvhost_mounts.
func (d *Driver) Mounts(recs ...abi.MountRecord) error {
	copy(abi.View[abi.MountRecord](d.scratch, len(recs)), recs)
	if st := d.D.Mounts(int32(len(recs))); st != 0 {
		return fmt.Errorf("policytest: kvhost_mounts: %v", abi.Status(st))
	}
	return nil
}

// Admit copies recs into the scratch area, calls kvhost_admit and copies
// the outputs back into recs.
func (d *Driver) Admit(recs []abi.AdmitRecord) error {
	v := abi.View[abi.AdmitRecord](d.scratch, len(recs))
	copy(v, recs)
	if st := d.D.Admit(int32(len(recs))); st != 0 {
		return fmt.Errorf("policytest: kvhost_admit: %v", abi.Status(st))
	}
	copy(recs, v)
	return nil
}

// Tick calls kvhost_tick at time now with room for max moves and returns a
// copy of the moves.
func (d *Driver) Tick(now uint64, max int) ([]abi.Move, error) {
	abi.View[abi.TickRequest](d.scratch, 1)[0] = abi.TickRequest{Time: now}
	st := d.D.Tick(int32(max))
	if st < 0 {
		return nil, fmt.Errorf("policytest: kvhost_tick: %v", abi.Status(st))
	}
	return append([]abi.Move(nil), abi.View[abi.Move](d.scratch[abi.TickHeaderSize:], int(st))...), nil
}

// Rank asks for the ranks of entries at time now (kvhost_rank) and returns
// a copy of the records, their outputs filled.
func (d *Driver) Rank(now uint64, entries ...uint64) ([]abi.RankRecord, error) {
	v := abi.View[abi.RankRecord](d.scratch, len(entries))
	for i, e := range entries {
		v[i] = abi.RankRecord{Entry: e, Time: now, State: abi.RankUnset}
	}
	if st := d.D.Rank(int32(len(entries))); st != 0 {
		return nil, fmt.Errorf("policytest: kvhost_rank: %v", abi.Status(st))
	}
	return append([]abi.RankRecord(nil), v...), nil
}
