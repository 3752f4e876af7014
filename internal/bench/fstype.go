package bench

import (
	"fmt"

	"github.com/kvhost/kvhost/internal/fstype"
)

// FSType names the file system holding path ("ext4", "tmpfs"), or gives
// its magic number in hex when it is not one kvhost knows.
func FSType(path string) (string, error) {
	_, name, err := fstype.OfPath(path)
	if err != nil {
		return "", fmt.Errorf("bench: %w", err)
	}
	return name, nil
}
