// Command wasm builds the ttl policy as a kvhost plugin module:
//
//	GOOS=wasip1 GOARCH=wasm go build -trimpath -buildmode=c-shared -o plugins/wasm/ttl.wasm ./plugins/ttl/wasm
package main

import (
	"github.com/kvhost/kvhost/abi/guest"
	"github.com/kvhost/kvhost/plugins/ttl"
)

func init() { guest.Register(ttl.New()) }

func main() {}
