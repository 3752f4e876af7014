package daemon

import (
	"context"
	"fmt"
	"log/slog"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/kvhost/kvhost/abi/guest"
	"github.com/kvhost/kvhost/gds"
	"github.com/kvhost/kvhost/host/policy"
	"github.com/kvhost/kvhost/internal/daemon/hostpath"
	"github.com/kvhost/kvhost/internal/engine"
	"github.com/kvhost/kvhost/internal/metrics"
	"github.com/kvhost/kvhost/internal/metrics/metricstest"
	"github.com/kvhost/kvhost/internal/server"
	"github.com/kvhost/kvhost/plugins/lru"
	"github.com/kvhost/kvhost/protocol"
	"github.com/kvhost/kvhost/region"
	"github.com/kvhost/kvhost/staging/gpu"
)

// fillDistinct sets every exported field of the struct v points to, and
// of the structs, slices (one element), maps (one entry) and pointers in
// it, to a value no other field gets, counting on n.
func fillDistinct(v reflect.Value, n *int) {
	*n++
	switch v.Kind() {
	case reflect.Struct:
		if v.Type() == reflect.TypeFor[time.Time]() {
			v.Set(reflect.ValueOf(time.Unix(int64(*n), 0)))
			return
		}
		for i := range v.NumField() {
			if v.Type().Field(i).IsExported() {
				fillDistinct(v.Field(i), n)
			}
		}
	case reflect.Pointer:
		v.Set(reflect.New(v.Type().Elem()))
		fillDistinct(v.Elem(), n)
	case reflect.Slice:
		v.Set(reflect.MakeSlice(v.Type(), 1, 1))
		fillDistinct(v.Index(0), n)
	case reflect.Map:
		k, e := reflect.New(v.Type().Key()).Elem(), reflect.New(v.Type().Elem()).Elem()
		fillDistinct(k, n)
		fillDistinct(e, n)
		v.Set(reflect.MakeMap(v.Type()))
		v.SetMapIndex(k, e)
	case reflect.String:
		v.SetString(fmt.Sprint("s", *n))
	case reflect.Bool:
		v.SetBool(true)
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		v.SetInt(int64(*n))
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		v.SetUint(uint64(*n))
	}
}

// sameFields checks that every field of the metrics snapshot got holds
// the same-named field of the part's stats src (path names them): the
// adapter copies each figure to its own field. A *T field of src becomes
// a bool of got: whether it is set.
func sameFields(t *testing.T, path string, got, src reflect.Value) {
	t.Helper()
	switch {
	case got.Kind() == reflect.Struct && got.Type() != reflect.TypeFor[time.Time]():
		for i := range got.NumField() {
			name := got.Type().Field(i).Name
			sf := src.FieldByName(name)
			if !sf.IsValid() {
				t.Errorf("%s.%s: no field %s in %s", path, name, name, src.Type())
				continue
			}
			sameFields(t, path+"."+name, got.Field(i), sf)
		}
	case got.Kind() == reflect.Slice && src.Kind() == reflect.Slice:
		if got.Len() != src.Len() {
			t.Errorf("%s: %d elements, want %d", path, got.Len(), src.Len())
			return
		}
		for i := range got.Len() {
			sameFields(t, fmt.Sprintf("%s[%d]", path, i), got.Index(i), src.Index(i))
		}
	case got.Kind() == reflect.Bool && src.Kind() == reflect.Pointer:
		if got.Bool() != !src.IsNil() {
			t.Errorf("%s = %v, want %v (set)", path, got.Bool(), !src.IsNil())
		}
	case !reflect.DeepEqual(got.Interface(), src.Interface()):
		t.Errorf("%s = %v, want %v", path, got.Interface(), src.Interface())
	}
}

// TestMetricsAdaptersCopyEachFigureToItsField fills each part's stats
// with a distinct value per field and checks that the metrics snapshot
// the adapter makes of it holds each under the field of the same name.
func TestMetricsAdaptersCopyEachFigureToItsField(t *testing.T) {
	for _, tc := range []struct {
		name  string
		src   any           // a pointer to the part's stats
		adapt func(any) any // the adapter, on *src
	}{
		{name: "engine", src: &engine.Stats{}, adapt: func(s any) any {
			return EngineMetrics(func() engine.Stats { return *s.(*engine.Stats) })()
		}},
		{name: "server", src: &server.Stats{}, adapt: func(s any) any {
			return ServerMetrics(func() server.Stats { return *s.(*server.Stats) })()
		}},
		{name: "policy", src: &PolicyInfo{}, adapt: func(s any) any {
			return PolicyMetrics(func() PolicyInfo { return *s.(*PolicyInfo) })()
		}},
		{name: "gpu files", src: &gpu.FileStats{}, adapt: func(s any) any {
			return GPUFileMetrics(func() gpu.FileStats { return *s.(*gpu.FileStats) })()
		}},
		{name: "cufile", src: &gds.HandleStats{}, adapt: func(s any) any {
			return CuFileMetrics(func() gds.HandleStats { return *s.(*gds.HandleStats) })()
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n := 0
			fillDistinct(reflect.ValueOf(tc.src).Elem(), &n)
			sameFields(t, tc.name, reflect.ValueOf(tc.adapt(tc.src)), reflect.ValueOf(tc.src).Elem())
		})
	}
}

// TestMetricsOutcomesAndRequestsKeepTheirLabels: each engine outcome a
// job counts is counted under its label (its name, "not_admitted" for
// "not admitted"), each control request under its protocol name, and
// the namespaces with gauges of their own are as many as a stats reply
// lists.
func TestMetricsOutcomesAndRequestsKeepTheirLabels(t *testing.T) {
	m := metrics.New("test")
	var ev engine.JobEvent
	ev.Direction = "store"
	for o := engine.OutcomePending; o <= engine.OutcomeFailed; o++ {
		ev.Outcomes[o] = int(o) + 1
	}
	JobObserver(m).ObserveJob(ev)
	keys := gather(t, m)
	for o := engine.OutcomeStored; o <= engine.OutcomeFailed; o++ {
		label := strings.ReplaceAll(o.String(), " ", "_")
		if got := metricstest.Value(keys, "kvhost_job_keys_total", map[string]string{"direction": "store", "outcome": label}); got != float64(o)+1 {
			t.Errorf("kvhost_job_keys_total{outcome=%q}: %v, want %d", label, got, int(o)+1)
		}
	}
	if metrics.MaxNamespaces != protocol.MaxStatsNamespaces {
		t.Errorf("metrics.MaxNamespaces = %d, want protocol.MaxStatsNamespaces = %d", metrics.MaxNamespaces, protocol.MaxStatsNamespaces)
	}
	observe := RequestObserver(m)
	for _, typ := range []protocol.Type{protocol.TypeLookup, protocol.TypeLookup, protocol.TypeDelete} {
		observe(typ, time.Millisecond)
	}
	fams := gather(t, m)
	for req, want := range map[string]float64{"lookup": 2, "delete": 1} {
		if got := metricstest.Value(fams, "kvhost_request_duration_seconds", map[string]string{"request": req}); got != want {
			t.Errorf("kvhost_request_duration_seconds{request=%q}: %v observations, want %v", req, got, want)
		}
	}
}

// TestMetricsReadARealEngineThroughTheAdapters opens an engine with the
// metrics as its job observer, stores two keys and checks what a scrape
// reads through the adapters: the job, its keys' outcomes, the engine's
// counters and its mount, with the space the operating system's statfs
// reports.
func TestMetricsReadARealEngineThroughTheAdapters(t *testing.T) {
	ctx := context.Background()
	m := metrics.New("test")
	dir := t.TempDir()
	eng, err := engine.Open(ctx, engine.Config{
		Host:   hostpath.Staging,
		Mounts: []engine.Mount{{Path: dir}},
		NewPolicy: func(idx policy.Index) (policy.Policy, error) {
			return policy.NewNative(func() guest.Policy { return lru.New() }, idx, policy.Config{Shards: 1})
		},
		Observer: JobObserver(m),
		Logger:   slog.New(slog.DiscardHandler),
	})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := eng.Close(ctx); err != nil {
			t.Error(err)
		}
	}()
	m.SetSources(metrics.Sources{Engine: EngineMetrics(eng.Stats), Statfs: StatfsMetrics(nil)})

	g := engine.Geometry{Model: "test/metrics", Layers: 2, KVHeads: 2, HeadSize: 64, DtypeSize: 2, TokensPerBlock: 16, TokensPerKey: 16, TPSize: 1}
	ns, err := eng.Declare(ctx, g)
	if err != nil {
		t.Fatal(err)
	}
	const blocks = 4
	bb := g.BlockBytes()
	layerBytes := int64(g.Planes()) * blocks * bb
	reg, err := region.NewHost("kv", int64(g.Layers)*layerBytes)
	if err != nil {
		t.Fatal(err)
	}
	defer reg.Close()
	var layers []engine.LayerTensor
	for l := range g.Layers {
		layers = append(layers, engine.LayerTensor{Region: reg, Offset: int64(l) * layerBytes, BlockStride: bb, PlaneStride: blocks * bb, NumBlocks: blocks})
	}
	cid, err := eng.RegisterCache(ns, layers)
	if err != nil {
		t.Fatal(err)
	}
	job, err := eng.Store(ctx, engine.StoreRequest{Cache: cid, Keys: [][]byte{[]byte("key-a"), []byte("key-b")}, Blocks: [][]int{{0}, {1}}})
	if err != nil {
		t.Fatal(err)
	}
	if res, err := job.Wait(ctx); err != nil || res.Count(engine.OutcomeStored) != 2 {
		t.Fatalf("store: %+v %v", res, err)
	}

	fams := gather(t, m)
	mount := map[string]string{"mount": eng.Stats().Mounts[0].Path}
	for _, c := range []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{"kvhost_jobs_total", map[string]string{"direction": "store", "memory": "host"}, 1},
		{"kvhost_job_keys_total", map[string]string{"direction": "store", "outcome": "stored"}, 2},
		{"kvhost_stored_keys_total", nil, 2},
		{"kvhost_keys", nil, 2},
		{"kvhost_namespaces", nil, 1},
		{"kvhost_namespace_keys", map[string]string{"model": "test/metrics"}, 2},
		{"kvhost_mount_entries", mount, float64(eng.Stats().Mounts[0].Entries)},
		{"kvhost_mount_stores_failing", mount, 0},
	} {
		if got := metricstest.Value(fams, c.name, c.labels); got != c.want {
			t.Errorf("%s%v = %v, want %v", c.name, c.labels, got, c.want)
		}
	}
	for _, name := range []string{"kvhost_mount_capacity_bytes", "kvhost_mount_fs_available_bytes", "kvhost_job_bytes_total"} {
		if got := metricstest.Value(fams, name, nil); got <= 0 {
			t.Errorf("%s = %v, want > 0", name, got)
		}
	}
}

// gather gathers m's registry by metric name.
func gather(t *testing.T, m *metrics.Metrics) metricstest.Families {
	t.Helper()
	fams, err := metricstest.Gather(m.Registry())
	if err != nil {
		t.Fatal(err)
	}
	return fams
}
