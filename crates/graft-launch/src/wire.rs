//! The rendezvous's frames on a TCP stream, every read and write bounded by a deadline: a
//! header of four little-endian words (magic, kind, a kind-specific word, payload length),
//! then the payload.

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// The first word of every frame.
const MAGIC: u64 = u64::from_le_bytes(*b"graftrv1");

/// The largest payload a frame may announce: anything larger is garbage.
const MAX_PAYLOAD: u64 = 1 << 30;

/// The shortest wait a bounded read or write is given (a socket refuses a zero timeout).
const MIN_WAIT: Duration = Duration::from_millis(1);

/// What a frame is.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Kind {
    /// A rank introduces itself to rank 0: payload its rank and world.
    Hello = 1,
    /// Rank 0 accepts: every rank joined.
    Welcome,
    /// Rank 0 refuses a hello: payload the reason and rank 0's world.
    Rejected,
    /// Rank 0 gave up waiting for ranks: payload the wait and the missing ranks.
    NeverJoined,
    /// Rank 0's bytes of a broadcast.
    Broadcast,
    /// A rank's part of an all-gather (the frame's word: the caller's tag).
    Part,
    /// Rank 0's answer to an all-gather: every part in rank order.
    Gathered,
    /// Rank 0's all-gather failed: payload why.
    Aborted,
    /// A watchdog's heartbeat: its rank is alive.
    Beat,
    /// A watchdog leaves on purpose (its rank finished): not a loss.
    Bye,
    /// Rank 0's watchdog found a rank gone (the frame's word: that rank).
    Gone,
}

impl Kind {
    const ALL: [Kind; 11] = [
        Kind::Hello,
        Kind::Welcome,
        Kind::Rejected,
        Kind::NeverJoined,
        Kind::Broadcast,
        Kind::Part,
        Kind::Gathered,
        Kind::Aborted,
        Kind::Beat,
        Kind::Bye,
        Kind::Gone,
    ];
}

/// A frame as read.
#[derive(Debug)]
pub(crate) struct Frame {
    pub(crate) kind: Kind,
    /// The kind-specific word (an all-gather's tag).
    pub(crate) word: u64,
    pub(crate) payload: Vec<u8>,
}

/// Why a frame could not be read or written.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum WireError {
    /// The deadline passed.
    TimedOut,
    /// The connection closed (`UnexpectedEof`) or failed.
    Lost(ErrorKind),
    /// Bytes arrived that are no frame.
    Garbled,
}

fn classify(e: &std::io::Error) -> WireError {
    match e.kind() {
        ErrorKind::WouldBlock | ErrorKind::TimedOut => WireError::TimedOut,
        kind => WireError::Lost(kind),
    }
}

/// The time left until `deadline`, at least [`MIN_WAIT`].
fn left(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(MIN_WAIT)
}

/// How much longer than rank 0 another rank waits for rank 0's answer, so that rank 0's own
/// report of a timeout arrives before the others give up on it.
pub(crate) fn grace(timeout: Duration) -> Duration {
    timeout / 4 + Duration::from_millis(250)
}

fn read_full(stream: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> Result<(), WireError> {
    let mut filled = 0;
    while filled < buf.len() {
        if Instant::now() >= deadline {
            return Err(WireError::TimedOut);
        }
        stream
            .set_read_timeout(Some(left(deadline)))
            .map_err(|e| classify(&e))?;
        match stream.read(&mut buf[filled..]) {
            Ok(0) => return Err(WireError::Lost(ErrorKind::UnexpectedEof)),
            Ok(n) => filled += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(classify(&e)),
        }
    }
    Ok(())
}

fn write_full(stream: &mut TcpStream, mut buf: &[u8], deadline: Instant) -> Result<(), WireError> {
    while !buf.is_empty() {
        if Instant::now() >= deadline {
            return Err(WireError::TimedOut);
        }
        stream
            .set_write_timeout(Some(left(deadline)))
            .map_err(|e| classify(&e))?;
        match stream.write(buf) {
            Ok(0) => return Err(WireError::Lost(ErrorKind::WriteZero)),
            Ok(n) => buf = &buf[n..],
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(classify(&e)),
        }
    }
    Ok(())
}

/// Writes one frame before `deadline`.
pub(crate) fn send(
    stream: &mut TcpStream,
    kind: Kind,
    word: u64,
    payload: &[u8],
    deadline: Instant,
) -> Result<(), WireError> {
    let mut bytes = Vec::with_capacity(32 + payload.len());
    for w in [MAGIC, kind as u64, word, payload.len() as u64] {
        bytes.extend_from_slice(&w.to_le_bytes());
    }
    bytes.extend_from_slice(payload);
    write_full(stream, &bytes, deadline)
}

/// Reads one frame before `deadline`.
pub(crate) fn receive(stream: &mut TcpStream, deadline: Instant) -> Result<Frame, WireError> {
    let mut header = [0u8; 32];
    read_full(stream, &mut header, deadline)?;
    let [magic, kind, word, len] =
        <[u64; 4]>::try_from(all_words(&header)).map_err(|_| WireError::Garbled)?;
    let kind = Kind::ALL
        .into_iter()
        .find(|k| *k as u64 == kind)
        .filter(|_| magic == MAGIC && len <= MAX_PAYLOAD)
        .ok_or(WireError::Garbled)?;
    let mut payload = vec![0; usize::try_from(len).map_err(|_| WireError::Garbled)?];
    read_full(stream, &mut payload, deadline)?;
    Ok(Frame {
        kind,
        word,
        payload,
    })
}

/// `d` in whole microseconds, as a word.
pub(crate) fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// `words` as little-endian bytes.
pub(crate) fn bytes_of(words: &[u64]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

/// Every little-endian word of `bytes` (whose length is a multiple of 8).
pub(crate) fn all_words(bytes: &[u8]) -> Vec<u64> {
    bytes
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
        .collect()
}

/// The I/O error kinds a failure report can carry across the wire, by code; any other
/// travels as `Other`.
const KINDS: [ErrorKind; 6] = [
    ErrorKind::UnexpectedEof,
    ErrorKind::ConnectionReset,
    ErrorKind::ConnectionAborted,
    ErrorKind::BrokenPipe,
    ErrorKind::WriteZero,
    ErrorKind::Other,
];

pub(crate) fn kind_code(kind: ErrorKind) -> u64 {
    KINDS
        .iter()
        .position(|k| *k == kind)
        .unwrap_or(KINDS.len() - 1) as u64
}

pub(crate) fn kind_of(code: u64) -> ErrorKind {
    usize::try_from(code)
        .ok()
        .and_then(|i| KINDS.get(i).copied())
        .unwrap_or(ErrorKind::Other)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (b, _) = listener.accept().unwrap();
        (a, b)
    }

    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(5)
    }

    #[test]
    fn frames_round_trip() {
        let (mut a, mut b) = pair();
        send(&mut a, Kind::Part, 7, b"ballot", soon()).unwrap();
        let f = receive(&mut b, soon()).unwrap();
        assert_eq!(
            (f.kind, f.word, &f.payload[..]),
            (Kind::Part, 7, &b"ballot"[..])
        );
    }

    #[test]
    fn a_silent_peer_times_out_at_the_deadline() {
        let (_a, mut b) = pair();
        let start = Instant::now();
        let err = receive(&mut b, start + Duration::from_millis(50)).unwrap_err();
        assert_eq!(err, WireError::TimedOut);
        assert!(start.elapsed() < Duration::from_secs(2));
    }

    #[test]
    fn a_closed_peer_is_lost_and_garbage_is_garbled() {
        let (a, mut b) = pair();
        drop(a);
        assert_eq!(
            receive(&mut b, soon()).unwrap_err(),
            WireError::Lost(ErrorKind::UnexpectedEof)
        );
        let (mut a, mut b) = pair();
        write_full(&mut a, &[0xAB; 32], soon()).unwrap();
        assert_eq!(receive(&mut b, soon()).unwrap_err(), WireError::Garbled);
    }

    #[test]
    fn error_kinds_travel_by_code() {
        for kind in KINDS {
            assert_eq!(kind_of(kind_code(kind)), kind);
        }
        assert_eq!(kind_of(kind_code(ErrorKind::NotFound)), ErrorKind::Other);
    }
}
