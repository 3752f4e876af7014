// Command wasm builds the tiered policy as a kvhost plugin module:
//
//	GOOS=wasip1 GOARCH=wasm go build -trimpath -buildmode=c-shared -o plugins/wasm/tiered.wasm ./plugins/tiered/wasm
package main

import (
	"github.com/kvhost/kvhost/abi/guest"
	"github.com/kvhost/kvhost/plugins/tiered"
)

func init() { guest.Register(tiered.New()) }

func main() {}
