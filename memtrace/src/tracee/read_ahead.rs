//! Reading ahead of the leak check: the heap walk and the marking's sweeps
//! read a process's memory in address order, a megabyte at a time, and
//! the kernel's copy (`/proc/PID/mem` or `process_vm_readv`: a page table
//! walk and a copy per page) is as long as the work done on what it read.
//! Helper threads read the blocks the check says it will read next
//! ([`ReadAhead::request`]) into buffers of their own, so the copy runs
//! beside the work; a read that the blocks hold is served from them
//! ([`ReadAhead::serve`]), any other is read as before by the caller.
//!
//! Only blocks read whole are kept: a hole, a short read or a process gone
//! make the block unusable, and the caller's own read then meets it and
//! counts it as it always did. The memory read does not change meanwhile
//! (a snapshot's child, or a process stopped for the check).

use std::collections::VecDeque;
use std::os::unix::fs::FileExt;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// Blocks are this long, aligned to it.
pub const BLOCK: u64 = 1 << 20;
/// Blocks requested and not yet consumed, at most (their buffers are
/// reused: 8 MiB in all).
const AHEAD: usize = 8;
/// Helper threads: two keep a reader busy while the other copies (the
/// walk does little with what it reads).
const HELPERS: usize = 2;

/// Where the helpers read from.
#[derive(Clone)]
pub enum Source {
    /// An open `/proc/PID/mem` (a snapshot's child).
    File(Arc<std::fs::File>),
    /// `process_vm_readv` of this pid.
    Pid(u32),
}

impl Source {
    /// Fills `buf` from `addr`; whether every byte was read.
    fn read_whole(&self, addr: u64, buf: &mut [u8]) -> bool {
        let mut done = 0;
        while done < buf.len() {
            let n = match self {
                Source::File(file) => file
                    .read_at(&mut buf[done..], addr + done as u64)
                    .unwrap_or(0),
                Source::Pid(pid) => {
                    let rest = &mut buf[done..];
                    let local = libc::iovec {
                        iov_base: rest.as_mut_ptr().cast(),
                        iov_len: rest.len(),
                    };
                    let remote = libc::iovec {
                        iov_base: (addr + done as u64) as *mut libc::c_void,
                        iov_len: rest.len(),
                    };
                    // SAFETY: `local` describes `rest`, writable for its
                    // length; the remote range is only read, and checked,
                    // by the kernel.
                    let n =
                        unsafe { libc::process_vm_readv(*pid as i32, &local, 1, &remote, 1, 0) };
                    usize::try_from(n).unwrap_or(0)
                }
            };
            if n == 0 {
                return false;
            }
            done += n;
        }
        true
    }
}

/// A block a helper read.
struct Filled {
    addr: u64,
    bytes: Vec<u8>,
    whole: bool,
}

/// The helpers, and the blocks requested of them.
pub struct ReadAhead {
    requests: Option<Sender<(u64, Vec<u8>)>>,
    results: Receiver<Filled>,
    helpers: Vec<JoinHandle<()>>,
    /// Blocks requested, not yet back.
    in_flight: Vec<u64>,
    /// Blocks back, oldest first.
    ready: VecDeque<Filled>,
    spare: Vec<Vec<u8>>,
    /// Bytes served from blocks read ahead.
    pub served: u64,
}

impl ReadAhead {
    /// Starts the helpers (none when threads cannot be made: every read
    /// is then the caller's own).
    pub fn new(source: Source) -> ReadAhead {
        let (requests, jobs) = mpsc::channel::<(u64, Vec<u8>)>();
        let (done, results) = mpsc::channel();
        let jobs = Arc::new(Mutex::new(jobs));
        let helpers = (0..HELPERS)
            .filter_map(|k| {
                let (jobs, done, source) = (Arc::clone(&jobs), done.clone(), source.clone());
                std::thread::Builder::new()
                    .name(format!("memtrace-read-{k}"))
                    .spawn(move || loop {
                        let job = match jobs.lock() {
                            Ok(jobs) => jobs.recv(),
                            Err(_) => return,
                        };
                        let Ok((addr, mut bytes)) = job else {
                            return;
                        };
                        bytes.resize(BLOCK as usize, 0);
                        let whole = source.read_whole(addr, &mut bytes);
                        if done.send(Filled { addr, bytes, whole }).is_err() {
                            return;
                        }
                    })
                    .ok()
            })
            .collect::<Vec<_>>();
        ReadAhead {
            requests: (!helpers.is_empty()).then_some(requests),
            results,
            helpers,
            in_flight: Vec::new(),
            ready: VecDeque::new(),
            spare: Vec::new(),
            served: 0,
        }
    }

    fn held(&self, block: u64) -> bool {
        self.in_flight.contains(&block) || self.ready.iter().any(|f| f.addr == block)
    }

    /// Takes in the blocks the helpers finished, without waiting.
    fn collect(&mut self) {
        while let Ok(filled) = self.results.try_recv() {
            self.in_flight.retain(|&b| b != filled.addr);
            self.ready.push_back(filled);
        }
    }

    /// Asks for the blocks covering `[addr, addr + len)`, in order, as far
    /// as [`AHEAD`] blocks allow: blocks behind `addr` are let go first,
    /// then the oldest of the others not wanted now.
    pub fn request(&mut self, addr: u64, len: u64) {
        if self.requests.is_none() {
            return;
        }
        self.collect();
        let first = addr / BLOCK * BLOCK;
        let end = addr.saturating_add(len);
        let wanted = |block: u64| block >= first && block < end;
        self.ready.retain_mut(|f| {
            let keep = f.addr + BLOCK > first;
            if !keep {
                self.spare.push(std::mem::take(&mut f.bytes));
            }
            keep
        });
        let mut block = first;
        while block < end {
            if !self.held(block) {
                if self.in_flight.len() + self.ready.len() >= AHEAD {
                    let Some(old) = self.ready.iter().position(|f| !wanted(f.addr)) else {
                        return;
                    };
                    if let Some(old) = self.ready.remove(old) {
                        self.spare.push(old.bytes);
                    }
                }
                let bytes = self.spare.pop().unwrap_or_default();
                let Some(requests) = &self.requests else {
                    return;
                };
                if requests.send((block, bytes)).is_err() {
                    return;
                }
                self.in_flight.push(block);
            }
            block += BLOCK;
        }
    }

    /// Fills `buf` from the blocks read ahead when they hold all of
    /// `[addr, addr + buf.len())` (waiting for those still being read);
    /// false when they do not, `buf` then untouched.
    pub fn serve(&mut self, addr: u64, buf: &mut [u8]) -> bool {
        let Some(end) = addr.checked_add(buf.len() as u64) else {
            return false;
        };
        if buf.is_empty() || self.in_flight.is_empty() && self.ready.is_empty() {
            return false;
        }
        let first = addr / BLOCK * BLOCK;
        let mut block = first;
        while block < end {
            if !self.held(block) {
                return false;
            }
            block += BLOCK;
        }
        // Wait for the blocks still being read.
        let mut block = first;
        while block < end {
            while self.in_flight.contains(&block) {
                let Ok(filled) = self.results.recv() else {
                    self.in_flight.clear();
                    return false;
                };
                self.in_flight.retain(|&b| b != filled.addr);
                self.ready.push_back(filled);
            }
            match self.ready.iter().find(|f| f.addr == block) {
                Some(f) if f.whole => {}
                _ => return false,
            }
            block += BLOCK;
        }
        let mut at = addr;
        while at < end {
            let block = at / BLOCK * BLOCK;
            let Some(filled) = self.ready.iter().find(|f| f.addr == block) else {
                return false;
            };
            let from = (at - block) as usize;
            let n = ((block + BLOCK).min(end) - at) as usize;
            let out = (at - addr) as usize;
            buf[out..out + n].copy_from_slice(&filled.bytes[from..from + n]);
            at += n as u64;
        }
        self.served += buf.len() as u64;
        true
    }
}

impl Drop for ReadAhead {
    fn drop(&mut self) {
        // No more requests: each helper ends after its current block.
        self.requests = None;
        for helper in self.helpers.drain(..) {
            let _ = helper.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A private anonymous mapping of `len` bytes (unmapped on drop).
    struct Area {
        at: *mut libc::c_void,
        len: usize,
    }

    impl Area {
        fn new(len: usize) -> Area {
            // SAFETY: a fresh private anonymous mapping, ours alone.
            let at = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            assert_ne!(at, libc::MAP_FAILED);
            Area { at, len }
        }

        /// The first block boundary inside it.
        fn block(&self) -> u64 {
            (self.at as u64).next_multiple_of(BLOCK)
        }
    }

    impl Drop for Area {
        fn drop(&mut self) {
            // SAFETY: the mapping made in `new` (a part may be unmapped
            // already: munmap skips it).
            unsafe { libc::munmap(self.at, self.len) };
        }
    }

    #[test]
    fn reads_ahead_serve_what_they_hold_and_nothing_else() {
        let area = Area::new(4 * BLOCK as usize);
        let base = area.block();
        // SAFETY: three blocks inside the mapping, written by this thread
        // only, through this slice alone.
        let data = unsafe { std::slice::from_raw_parts_mut(base as *mut u8, 3 * BLOCK as usize) };
        for (k, byte) in data.iter_mut().enumerate() {
            *byte = (k % 251) as u8;
        }
        let file = std::fs::File::open("/proc/self/mem").expect("own /proc/self/mem");
        let mut ahead = ReadAhead::new(Source::File(Arc::new(file)));
        let mut buf = vec![0u8; 5000];
        // Nothing requested: nothing served.
        assert!(!ahead.serve(base, &mut buf));
        ahead.request(base, 3 * BLOCK);
        // Across a block's end, within what was requested.
        let at = base + BLOCK - 100;
        assert!(ahead.serve(at, &mut buf));
        let from = (at - base) as usize;
        assert_eq!(buf, data[from..from + 5000]);
        assert_eq!(ahead.served, 5000);
        // Past the blocks requested: the caller reads.
        assert!(!ahead.serve(base + 3 * BLOCK, &mut buf));
        // Blocks behind a new request are let go.
        ahead.request(base + 2 * BLOCK, BLOCK);
        assert!(!ahead.serve(base, &mut buf[..8]));
        assert!(ahead.serve(base + 2 * BLOCK, &mut buf[..8]));
        assert_eq!(buf[..8], data[2 * BLOCK as usize..][..8]);
    }

    #[test]
    fn a_block_with_a_hole_is_not_served() {
        let area = Area::new(2 * BLOCK as usize);
        let block = area.block();
        // SAFETY: a page inside the mapping above.
        unsafe { libc::munmap((block + 8192) as *mut libc::c_void, 4096) };
        let mut ahead = ReadAhead::new(Source::Pid(std::process::id()));
        ahead.request(block, BLOCK);
        let mut buf = vec![0u8; 16];
        assert!(!ahead.serve(block, &mut buf));
    }
}
