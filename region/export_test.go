package region

import "runtime/debug"

var debugSetPanicOnFault = debug.SetPanicOnFault
