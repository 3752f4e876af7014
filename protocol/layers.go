package protocol

import "fmt"

// Layer-range loads (protocol version 2): a LoadLayers frame loads a range
// of layers of every key, so that a client can load layer i while its
// model computes layer i-1. A version-2 Welcome announces the daemon's
// features; FeatureLayerLoads says it serves LoadLayers. docs/protocol.md
// ("Layer-range loads") is the specification.

// TypeLoadLayers is a Load of a layer range: the Load body followed by the
// range, answered like a Load (JobAccepted, then a Completion of kind
// JobLoad).
const TypeLoadLayers Type = 0x0014

// Feature is a bit of a version-2 Welcome's features: what the daemon
// serves beyond version 1.
type Feature uint64

// Features a daemon announces.
const (
	// FeatureLayerLoads: the daemon serves LoadLayers.
	FeatureLayerLoads Feature = 1 << 0
)

// layerRangeSize is the encoded size of a LayerRange.
const layerRangeSize = 8

// LayerRange is the layers [First, First+Count) of every key of a
// LoadLayers; Count 0 is every layer (First is 0 then).
type LayerRange struct {
	First uint32 // the first layer loaded
	Count uint32 // the layers loaded; 0: every layer
}

// Check reports a range no namespace can have as an error naming it: a
// First with Count 0, or an end past MaxLayers. Whether the range fits
// the namespace's layers is the daemon's to check. Decoders call it;
// clients call it before sending.
func (r LayerRange) Check() error {
	switch {
	case r.Count == 0 && r.First != 0:
		return fmt.Errorf("%w: layer range first %d with count 0: count 0 means every layer, first must be 0 then", ErrMalformed, r.First)
	case uint64(r.First)+uint64(r.Count) > MaxLayers:
		return fmt.Errorf("%w: layer range first %d count %d ends past layer %d (at most %d layers)", ErrMalformed, r.First, r.Count, MaxLayers, MaxLayers)
	}
	return nil
}

// String writes the range as "layers [first, end)", or "every layer".
func (r LayerRange) String() string {
	if r.Count == 0 {
		return "every layer"
	}
	return fmt.Sprintf("layers [%d, %d)", r.First, uint64(r.First)+uint64(r.Count))
}

// appendLayerRange encodes: u32 first | u32 count.
func appendLayerRange(b []byte, r LayerRange) []byte {
	return appendU32(appendU32(b, r.First), r.Count)
}

// decodeLayerRange decodes a range and checks it (LayerRange.Check).
func decodeLayerRange(d *decoder) LayerRange {
	r := LayerRange{First: d.u32("first layer"), Count: d.u32("layer count")}
	if d.err == nil {
		if err := r.Check(); err != nil {
			d.err = err
		}
	}
	return r
}

// newLayerMessage returns a new message of layer-range loads' type t, or
// nil.
func newLayerMessage(t Type) Message {
	switch t {
	case TypeLoadLayers:
		return &Transfer{Kind: JobLoad, Layers: new(LayerRange)}
	case TypeLoadLayers | TypeReply:
		return &JobAccepted{T: t}
	}
	return nil
}
