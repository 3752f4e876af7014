package engine

import (
	"context"
	"errors"
	"strings"
	"testing"
)

// TestLoadLayerRangeValidation: a load's layer range outside the
// namespace's layers, or a first layer with count 0, is refused with
// ErrInvalid naming the range and the layer count.
func TestLoadLayerRangeValidation(t *testing.T) {
	e := openEngine(t, Config{Mounts: []Mount{{Path: t.TempDir()}}, Policy: newTestPolicy(1, 0)})
	ctx := context.Background()
	g := smallGeometry(true) // 4 layers
	ns, err := e.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	c := newTestCache(t, e, ns, g, 8, layoutPlaneFirst)
	for _, tc := range []struct {
		name string
		r    LayerRange
		want string
	}{
		{"first without count", LayerRange{First: 1}, "first 1 with count 0"},
		{"negative first", LayerRange{First: -1, Count: 1}, "first -1 count 1"},
		{"negative count", LayerRange{First: 0, Count: -1}, "first 0 count -1"},
		{"past the last layer", LayerRange{First: 3, Count: 2}, "<= 4 layers"},
		{"first past the layers", LayerRange{First: 4, Count: 1}, "<= 4 layers"},
	} {
		_, err := e.Load(ctx, LoadRequest{Cache: c.id, Keys: testKeys("a", 1), Blocks: [][]int{{0, 1, 2, 3}}, Layers: tc.r})
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: load of %v: %v, want ErrInvalid naming %q", tc.name, tc.r, err, tc.want)
		}
	}
}
