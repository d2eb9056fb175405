//! graft-cuda: placeholder, being written.
