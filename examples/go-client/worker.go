// Command go-client is a worker's use of the Go client, as a program to
// run against a daemon: it registers a paged KV cache in a memfd,
// declares its geometry, stores one key, looks it up and loads it back.
//
// Build and run it from this checkout (it is in kvhost's module, so no
// download of github.com/kvhost/kvhost is needed), with a daemon running
// (make run, in another terminal):
//
//	go run ./examples/go-client                  # the default socket, or $KVHOST_SOCKET
//	go run ./examples/go-client -socket /run/kvhost/kvhost.sock
//
// A program in a module of its own imports github.com/kvhost/kvhost/client
// from a checkout with a replace directive (the module path is not
// published):
//
//	go mod edit -require=github.com/kvhost/kvhost@v0.0.0 -replace=github.com/kvhost/kvhost=/path/to/kvhost
//	go mod tidy
//
// The file is not named main.go: the Makefile builds every
// examples/NAME/main.go as a wasm policy plugin.
package main

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"os"
	"time"

	"github.com/kvhost/kvhost/client"
)

func main() {
	socket := flag.String("socket", client.DefaultSocket(), "the daemon's Unix socket `path` (default: $KVHOST_SOCKET, else the daemon's default)")
	flag.Parse()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := run(ctx, *socket); err != nil {
		fmt.Fprintln(os.Stderr, "go-client:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, socket string) error {
	c, err := client.Dial(ctx, socket, "go-client")
	if err != nil {
		return fmt.Errorf("connect to %s: %w", socket, err)
	}
	defer c.Close()

	g := client.Geometry{Model: "example/tiny", Layers: 4, KVHeads: 2, HeadSize: 64, DtypeSize: 2,
		TokensPerBlock: 16, TokensPerKey: 64, TPSize: 1}
	const blocks = 64 // paged blocks per layer tensor
	bb := g.BlockBytes()
	mem, err := client.NewMemfd("kv-cache", int64(g.Layers)*2*blocks*bb)
	if err != nil {
		return err
	}
	defer mem.Close()
	region, err := c.RegisterMemfd(ctx, mem)
	if err != nil {
		return err
	}
	ns, err := c.Declare(ctx, g)
	if err != nil {
		return err
	}
	layers := make([]client.Layer, g.Layers)
	for l := range layers { // vLLM's [2, num_blocks, ...] layout per layer
		layers[l] = client.Layer{Region: uint32(region), NumBlocks: blocks,
			Offset: int64(l) * 2 * blocks * bb, BlockStride: bb, PlaneStride: blocks * bb}
	}
	cache, err := c.RegisterCache(ctx, ns.ID, layers)
	if err != nil {
		return err
	}

	ids := make([]uint32, ns.BlocksPerKey) // the cache blocks of one key
	for i := range ids {
		ids[i] = uint32(i)
	}
	data := mem.Bytes()
	want := bytes.Repeat([]byte("kv"), int(bb)/2)
	copy(data, want) // layer 0, K plane, block 0
	key := [][]byte{[]byte("prefix-hash-0")}
	if err := do(ctx, c.Store, cache, key, ids, "store"); err != nil {
		return err
	}
	n, err := c.Lookup(ctx, ns.ID, key)
	if err != nil {
		return err
	}
	fmt.Println("lookup:", n)
	clear(data[:bb])
	if err := do(ctx, c.Load, cache, key, ids, "load"); err != nil {
		return err
	}
	if !bytes.Equal(data[:bb], want) {
		return fmt.Errorf("the loaded block differs from the stored one")
	}
	return nil
}

// do runs one store or load job of key into blocks, prints its outcome
// and returns an error, with the daemon's reason, unless the key was
// stored (or already present) or loaded.
func do(ctx context.Context, start func(context.Context, client.CacheID, [][]byte, [][]uint32) (*client.Job, error),
	cache client.CacheID, key [][]byte, blocks []uint32, what string) error {
	job, err := start(ctx, cache, key, [][]uint32{blocks})
	if err != nil {
		return err
	}
	res, err := job.Wait(ctx)
	if err != nil {
		return err
	}
	o := res.Keys[0].Outcome
	fmt.Printf("%s: %s\n", what, o)
	switch o {
	case client.OutcomeStored, client.OutcomePresent, client.OutcomeLoaded:
		return nil
	}
	return fmt.Errorf("%s %s: %s", what, o, res.Message)
}
