// Command wasm builds the lfu policy as a kvhost plugin module:
//
//	GOOS=wasip1 GOARCH=wasm go build -trimpath -buildmode=c-shared -o plugins/wasm/lfu.wasm ./plugins/lfu/wasm
package main

import (
	"github.com/kvhost/kvhost/abi/guest"
	"github.com/kvhost/kvhost/plugins/lfu"
)

func init() { guest.Register(lfu.New()) }

func main() {}
