//! graft-sim: placeholder, being written.
