module github.com/kvhost/kvhost

go 1.26.0

require (
	github.com/BurntSushi/toml v1.6.0 // indirect
	github.com/lmittmann/tint v1.2.1 // indirect
	github.com/tetratelabs/wazero v1.12.0 // indirect
	golang.org/x/sys v0.49.0 // indirect
)
