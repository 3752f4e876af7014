// Command wasm builds the lru policy as a kvhost plugin module:
//
//	GOOS=wasip1 GOARCH=wasm go build -trimpath -buildmode=c-shared -o plugins/wasm/lru.wasm ./plugins/lru/wasm
package main

import (
	"github.com/kvhost/kvhost/abi/guest"
	"github.com/kvhost/kvhost/plugins/lru"
)

func init() { guest.Register(lru.New()) }

func main() {}
