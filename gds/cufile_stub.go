//go:build !linux || !cgo

package gds

import "fmt"

// loadAPI fails: this build cannot load libraries (it needs Linux and cgo).
func loadAPI(paths []string) (api, error) {
	return nil, fmt.Errorf("%w: built without cgo or not on Linux", ErrUnavailable)
}
