package protocol

import (
	"bytes"
	"errors"
	"strings"
	"testing"
)

// layerMessages are samples of layer-range loads and version-2 Welcomes.
func layerMessages() []Message {
	return []Message{
		&Transfer{Kind: JobLoad, Cache: 1, Keys: [][]byte{[]byte("k1"), []byte("k2")}, Blocks: [][]uint32{{1, 2}, {NoBlock, 4}}, Layers: &LayerRange{First: 3, Count: 5}},
		&Transfer{Kind: JobLoad, Cache: 2, Keys: [][]byte{[]byte("k")}, Blocks: [][]uint32{{7}}, Layers: &LayerRange{}},
		&Transfer{Kind: JobLoad, Cache: 2, Keys: [][]byte{[]byte("k")}, Blocks: [][]uint32{{7}}, Layers: &LayerRange{First: MaxLayers - 1, Count: 1}},
		&JobAccepted{T: TypeLoadLayers | TypeReply, Job: 44},
		&Welcome{Version: 2, MaxFrame: 1 << 20, MaxKeys: MaxKeysPerRequest, MaxKeyLen: MaxKeyLen, Server: "kvhost", Features: FeatureLayerLoads},
		&Welcome{Version: 2, MaxFrame: 1 << 20, Server: "no features"},
	}
}

func TestLayerMessagesRoundTrip(t *testing.T) {
	checkRoundTrips(t, layerMessages())
}

// TestLoadLayersBodyIsALoadBodyAndTheRange: the LoadLayers body is the
// Load body of the same keys and blocks followed by u32 first, u32 count.
func TestLoadLayersBodyIsALoadBodyAndTheRange(t *testing.T) {
	load := &Transfer{Kind: JobLoad, Cache: 1, Keys: [][]byte{[]byte("k")}, Blocks: [][]uint32{{1, 2}}}
	ranged := *load
	ranged.Layers = &LayerRange{First: 2, Count: 3}
	if ranged.Type() != TypeLoadLayers || load.Type() != TypeLoad {
		t.Fatalf("types %s and %s, want load-layers and load", ranged.Type(), load.Type())
	}
	want := append(load.AppendBody(nil), 2, 0, 0, 0, 3, 0, 0, 0)
	if got := ranged.AppendBody(nil); !bytes.Equal(got, want) {
		t.Fatalf("LoadLayers body % x, want % x", got, want)
	}
}

// TestLoadLayersRejects: a LoadLayers whose range no namespace can have,
// or whose body is cut short, does not decode, and the error names what
// is wrong.
func TestLoadLayersRejects(t *testing.T) {
	load := (&Transfer{Kind: JobLoad, Cache: 1, Keys: [][]byte{[]byte("k")}, Blocks: [][]uint32{{1, 2}}}).AppendBody(nil)
	withRange := func(first, count uint32) []byte {
		return appendLayerRange(append([]byte{}, load...), LayerRange{First: first, Count: count})
	}
	for _, tc := range []struct {
		name string
		body []byte
		want string
	}{
		{"no range", load, "block ids"},
		{"body shorter than a range", load[:5], "load-layers body of 5 bytes"},
		{"first with count 0", withRange(4, 0), "layer range first 4 with count 0"},
		{"count past the most layers", withRange(0, MaxLayers+1), "layer range first 0 count 4097 ends past layer 4096"},
		{"first+count past the most layers", withRange(MaxLayers-1, 2), "layer range first 4095 count 2 ends past layer 4096"},
		{"first+count overflowing u32", withRange(0xFFFFFFFF, 1), "layer range first 4294967295 count 1 ends past"},
		{"range cut short", withRange(1, 2)[:len(load)+7], "block ids"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Decode(TypeLoadLayers, tc.body)
			if !errors.Is(err, ErrMalformed) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Decode = %v, want ErrMalformed containing %q", err, tc.want)
			}
		})
	}
}

// TestWelcomeVersions: a version-1 Welcome is the layout every client
// reads (no features, exact length); a version-2 one carries the features
// after the server name and may be followed by a later daemon's bytes.
func TestWelcomeVersions(t *testing.T) {
	v1 := &Welcome{Version: 1, MaxFrame: MinFrame, Server: "old", Features: FeatureLayerLoads}
	b := v1.AppendBody(nil)
	if len(b) != 32+1+len("old") {
		t.Fatalf("version-1 Welcome of %d bytes, want %d: features leaked into it", len(b), 32+1+len("old"))
	}
	got, err := Decode(TypeHello|TypeReply, b)
	if err != nil || got.(*Welcome).Features != 0 {
		t.Fatalf("version-1 Welcome decoded as %+v, %v; want no features", got, err)
	}
	if _, err := Decode(TypeHello|TypeReply, append(b, 0)); !errors.Is(err, ErrMalformed) {
		t.Fatalf("version-1 Welcome with a trailing byte: %v, want ErrMalformed", err)
	}
	v2 := &Welcome{Version: 2, MaxFrame: MinFrame, Server: "new", Features: FeatureLayerLoads | 1<<9}
	got, err = Decode(TypeHello|TypeReply, append(v2.AppendBody(nil), 1, 2, 3))
	if err != nil || got.(*Welcome).Features != v2.Features {
		t.Fatalf("version-2 Welcome with later bytes decoded as %+v, %v; want features %#x", got, err, uint64(v2.Features))
	}
	if _, err := Decode(TypeHello|TypeReply, v2.AppendBody(nil)[:len(b)+1]); !errors.Is(err, ErrMalformed) {
		t.Fatalf("version-2 Welcome without its features: %v, want ErrMalformed", err)
	}
}

func TestLayerRangeString(t *testing.T) {
	for _, tc := range []struct {
		r    LayerRange
		want string
	}{
		{LayerRange{}, "every layer"},
		{LayerRange{First: 2, Count: 3}, "layers [2, 5)"},
		{LayerRange{First: 0xFFFFFFFF, Count: 1}, "layers [4294967295, 4294967296)"},
	} {
		if got := tc.r.String(); got != tc.want {
			t.Errorf("%#v.String() = %q, want %q", tc.r, got, tc.want)
		}
	}
}
