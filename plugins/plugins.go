// Package plugins holds kvhost's built-in placement policies. Each
// plugins/NAME package is an ordinary Go policy (see abi/guest), also a
// readable example for plugin authors; plugins/NAME/wasm builds it into the
// NAME.wasm module that this package embeds, so that kvhost runs with a
// sane default and no flags.
package plugins

import (
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"sort"
	"strings"

	"github.com/kvhost/kvhost/abi/guest"
	"github.com/kvhost/kvhost/plugins/lfu"
	"github.com/kvhost/kvhost/plugins/lru"
	"github.com/kvhost/kvhost/plugins/sharded"
	"github.com/kvhost/kvhost/plugins/tiered"
	"github.com/kvhost/kvhost/plugins/ttl"
)

//go:embed wasm
var builtin embed.FS

// Default is the name of the policy kvhost uses when none is configured.
const Default = "lru"

// ErrUnknown is returned for a name that is not a built-in policy.
var ErrUnknown = errors.New("plugins: no built-in policy of that name")

// Names lists the built-in policies embedded in this binary.
func Names() []string {
	entries, _ := fs.ReadDir(builtin, "wasm")
	var names []string
	for _, e := range entries {
		if name, ok := strings.CutSuffix(e.Name(), ".wasm"); ok {
			names = append(names, name)
		}
	}
	sort.Strings(names)
	return names
}

// Wasm returns the module of the built-in policy name.
func Wasm(name string) ([]byte, error) {
	b, err := builtin.ReadFile("wasm/" + name + ".wasm")
	if err != nil {
		return nil, fmt.Errorf("%w: %q (built in: %s)",
			ErrUnknown, name, strings.Join(Names(), ", "))
	}
	return b, nil
}

// Native returns the constructor of the built-in policy name built
// natively: the same Go code as its module, which kvhost serves while the
// module compiles (policy.Config.Interim). ok is false for a name that
// is not a built-in policy.
func Native(name string) (newPolicy func() guest.Policy, ok bool) {
	switch name {
	case lfu.Name:
		return func() guest.Policy { return lfu.New() }, true
	case lru.Name:
		return func() guest.Policy { return lru.New() }, true
	case sharded.Name:
		return func() guest.Policy { return sharded.New() }, true
	case tiered.Name:
		return func() guest.Policy { return tiered.New() }, true
	case ttl.Name:
		return func() guest.Policy { return ttl.New() }, true
	}
	return nil, false
}
