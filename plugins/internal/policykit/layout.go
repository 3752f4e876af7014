package policykit

import (
	"github.com/kvhost/kvhost/abi"
	"github.com/kvhost/kvhost/abi/guest"
)

// Layout is the chunk layout a policy gives every namespace, read from the
// configuration keys
//
//	keys_per_file = 1..256  (default 1)
//	order         = layer | block  (default layer)
type Layout struct {
	KeysPerFile uint32 // 1..abi.MaxKeysPerFile keys share one file
	Order       uint32 // abi.OrderLayerMajor or abi.OrderBlockMajor
}

// LayoutKeys returns the configuration keys ParseLayout reads.
func LayoutKeys() []string { return []string{"keys_per_file", "order"} }

// ParseLayout reads the layout keys of cfg.
func ParseLayout(cfg guest.Config) (Layout, error) {
	l := Layout{KeysPerFile: abi.DefaultKeysPerFile, Order: abi.DefaultOrder}
	k, err := cfg.Int("keys_per_file", abi.DefaultKeysPerFile)
	if err != nil {
		return l, err
	}
	if k < 1 || k > abi.MaxKeysPerFile {
		return l, &guest.ConfigError{Key: "keys_per_file", Value: cfg.String("keys_per_file", ""), Want: "an integer from 1 to 256"}
	}
	l.KeysPerFile = uint32(k)
	switch v := cfg.String("order", "layer"); v {
	case "layer":
		l.Order = abi.OrderLayerMajor
	case "block":
		l.Order = abi.OrderBlockMajor
	default:
		return l, &guest.ConfigError{Key: "order", Value: v, Want: `"layer" or "block"`}
	}
	return l, nil
}

// Apply writes the layout into r's output fields.
func (l Layout) Apply(r *abi.NamespaceRecord) {
	r.KeysPerFile, r.Order = l.KeysPerFile, l.Order
}

// ConfigFailure turns a configuration error into the error a policy's Init
// returns: abi.StatusUnsupported ("configuration not supported"), with the
// policy's name in front of the message.
func ConfigFailure(policy string, err error) error {
	return &guest.StatusError{Status: abi.StatusUnsupported, Msg: policy + ": " + err.Error()}
}
