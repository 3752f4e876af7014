package client_test

import (
	"context"
	"fmt"
	"log"

	"github.com/kvhost/kvhost/client"
)

// Example stores one key from a paged cache in a memfd and loads it back.
// It needs a running daemon, so it is compiled but not run;
// examples/go-client is the same as a program to run from this checkout
// (go run ./examples/go-client). client.DefaultSocket is $KVHOST_SOCKET,
// else the daemon's own default socket.
func Example() {
	ctx := context.Background()
	c, err := client.Dial(ctx, client.DefaultSocket(), "worker-0")
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()

	g := client.Geometry{Model: "llama-3.1-8b", Layers: 32, KVHeads: 8, HeadSize: 128, DtypeSize: 2,
		TokensPerBlock: 16, TokensPerKey: 256, TPSize: 1}
	const blocks = 1024
	bb := g.BlockBytes()
	mem, err := client.NewMemfd("kv-cache", int64(g.Layers)*2*blocks*bb)
	if err != nil {
		log.Fatal(err)
	}
	defer mem.Close()
	region, err := c.RegisterMemfd(ctx, mem)
	if err != nil {
		log.Fatal(err)
	}
	ns, err := c.Declare(ctx, g)
	if err != nil {
		log.Fatal(err)
	}
	layers := make([]client.Layer, g.Layers)
	for l := range layers { // vLLM's [2, num_blocks, ...] layout per layer
		layers[l] = client.Layer{Region: uint32(region), NumBlocks: blocks,
			Offset: int64(l) * 2 * blocks * bb, BlockStride: bb, PlaneStride: blocks * bb}
	}
	cache, err := c.RegisterCache(ctx, ns.ID, layers)
	if err != nil {
		log.Fatal(err)
	}
	key := [][]byte{[]byte("prefix-hash-0")}
	ids := make([]uint32, ns.BlocksPerKey)
	for i := range ids {
		ids[i] = uint32(i)
	}
	job, err := c.Store(ctx, cache, key, [][]uint32{ids})
	if err != nil {
		log.Fatal(err)
	}
	res, err := job.Wait(ctx)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(res.Keys[0].Outcome)
	if n, _ := c.Lookup(ctx, ns.ID, key); n == 1 {
		job, _ = c.Load(ctx, cache, key, [][]uint32{ids})
		res, _ = job.Wait(ctx)
		fmt.Println(res.Keys[0].Outcome)
	}
}

// ExampleClient_LoadLayers loads a key layer by layer, as a model that
// computes layer i while layer i+1 loads would: one job per layer, each
// waited for before its layer is used. A daemon that does not serve
// layer-range loads gets one whole Load instead.
func ExampleClient_LoadLayers() {
	ctx := context.Background()
	c, err := client.Dial(ctx, client.DefaultSocket(), "worker-0")
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	var cache client.CacheID // a registered cache of a 32-layer namespace (see Example)
	key, blocks := [][]byte{[]byte("prefix-hash-0")}, [][]uint32{{0, 1, 2, 3}}
	if !c.Supports(client.FeatureLayerLoads) {
		job, err := c.Load(ctx, cache, key, blocks)
		if err != nil {
			log.Fatal(err)
		}
		job.Wait(ctx)
		return
	}
	jobs := make([]*client.Job, 32)
	for l := range jobs { // submitted at once; the daemon runs them as its queues allow
		if jobs[l], err = c.LoadLayers(ctx, cache, key, blocks, l, 1); err != nil {
			log.Fatal(err)
		}
	}
	for l, job := range jobs {
		res, err := job.Wait(ctx)
		if err != nil || res.Err() != nil {
			log.Fatalf("layer %d: %v %v", l, err, res.Err())
		}
		// layer l's blocks hold the key's bytes now: compute it
	}
}
