// Command wasm builds the sharded policy as a kvhost plugin module:
//
//	GOOS=wasip1 GOARCH=wasm go build -trimpath -buildmode=c-shared -o plugins/wasm/sharded.wasm ./plugins/sharded/wasm
package main

import (
	"github.com/kvhost/kvhost/abi/guest"
	"github.com/kvhost/kvhost/plugins/sharded"
)

func init() { guest.Register(sharded.New()) }

func main() {}
