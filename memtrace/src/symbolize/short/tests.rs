//! Short names on real demangled names: libstdc++'s and LLVM 15's symbol
//! tables (`nm -DC`), PyTorch's dispatcher frames, Rust symbols as
//! rustc-demangle writes them, and malformed input.

use super::*;

/// Each case: the full name, its short form (no width).
fn check(cases: &[(&str, &str)]) {
    for (full, expected) in cases {
        assert_eq!(shorten(full), *expected, "shortening {full}");
        // A short name is its own short name.
        assert_eq!(shorten(expected), *expected, "shortening again {expected}");
    }
}

#[test]
fn libstdcxx_names_keep_their_qualified_name() {
    check(&[
        (
            "std::__cxx11::basic_string<wchar_t, std::char_traits<wchar_t>, std::allocator<wchar_t> >::replace(__gnu_cxx::__normal_iterator<wchar_t const*, std::__cxx11::basic_string<wchar_t, std::char_traits<wchar_t>, std::allocator<wchar_t> > >, __gnu_cxx::__normal_iterator<wchar_t const*, std::__cxx11::basic_string<wchar_t, std::char_traits<wchar_t>, std::allocator<wchar_t> > >, wchar_t const*, wchar_t const*)",
            "std::__cxx11::basic_string<…>::replace(…)",
        ),
        // A template function: its return type goes.
        (
            "void std::__cxx11::basic_string<wchar_t, std::char_traits<wchar_t>, std::allocator<wchar_t> >::insert<__gnu_cxx::__normal_iterator<wchar_t*, std::__cxx11::basic_string<wchar_t, std::char_traits<wchar_t>, std::allocator<wchar_t> > > >(__gnu_cxx::__normal_iterator<wchar_t*, std::__cxx11::basic_string<wchar_t, std::char_traits<wchar_t>, std::allocator<wchar_t> > >, __gnu_cxx::__normal_iterator<wchar_t*, std::__cxx11::basic_string<wchar_t, std::char_traits<wchar_t>, std::allocator<wchar_t> > >)",
            "std::__cxx11::basic_string<…>::insert<…>(…)",
        ),
        (
            "std::basic_string<wchar_t, std::char_traits<wchar_t>, std::allocator<wchar_t> >::find_last_of(wchar_t const*, unsigned long) const",
            "std::basic_string<…>::find_last_of(…)",
        ),
        ("std::locale::name[abi:cxx11]() const", "std::locale::name[abi:cxx11]()"),
        (
            "std::ios_base::failure[abi:cxx11]::failure(char const*, std::error_code const&)",
            "std::ios_base::failure[abi:cxx11]::failure(…)",
        ),
        (
            "std::filesystem::current_path[abi:cxx11](std::error_code&)",
            "std::filesystem::current_path[abi:cxx11](…)",
        ),
        ("std::locale::classic()", "std::locale::classic()"),
        ("operator new(unsigned long)", "operator new(…)"),
        ("operator delete[](void*, unsigned long)", "operator delete[](…)"),
        ("clone for operator new[](unsigned long)", "clone for operator new[](…)"),
        ("std::bad_alloc::~bad_alloc()", "std::bad_alloc::~bad_alloc()"),
        ("malloc", "malloc"),
        ("__libc_start_call_main", "__libc_start_call_main"),
    ]);
}

#[test]
fn operators_keep_their_symbols() {
    check(&[
        (
            "std::filesystem::path::_List::_Impl_deleter::operator()(std::filesystem::path::_List::_Impl*) const",
            "std::filesystem::path::_List::_Impl_deleter::operator()(…)",
        ),
        (
            "std::tr1::hash<std::__cxx11::basic_string<char, std::char_traits<char>, std::allocator<char> > >::operator()(std::__cxx11::basic_string<char, std::char_traits<char>, std::allocator<char> >) const",
            "std::tr1::hash<…>::operator()(…)",
        ),
        (
            "std::istream::operator>>(std::basic_ios<char, std::char_traits<char> >& (*)(std::basic_ios<char, std::char_traits<char> >&))",
            "std::istream::operator>>(…)",
        ),
        (
            "std::basic_ostream<char, std::char_traits<char> >& std::operator<< <std::char_traits<char> >(std::basic_ostream<char, std::char_traits<char> >&, signed char const*)",
            "std::operator<< <…>(…)",
        ),
        (
            "llvm::AttributeImpl::operator<(llvm::AttributeImpl const&) const",
            "llvm::AttributeImpl::operator<(…)",
        ),
        (
            "std::locale::operator==(std::locale const&) const",
            "std::locale::operator==(…)",
        ),
        (
            "std::unique_ptr<Foo, std::default_delete<Foo> >::operator->() const",
            "std::unique_ptr<…>::operator->()",
        ),
        ("a::b::operator<=>(a::b const&) const", "a::b::operator<=>(…)"),
        ("Vec::operator[](unsigned long) &&", "Vec::operator[](…)"),
        ("operator\"\" _km(unsigned long long)", "operator\"\" _km(…)"),
        // Conversion operators keep their (shortened) type.
        (
            "std::basic_string<wchar_t, std::char_traits<wchar_t>, std::allocator<wchar_t> >::operator std::basic_string_view<wchar_t, std::char_traits<wchar_t> >() const",
            "std::basic_string<…>::operator std::basic_string_view<…>()",
        ),
        (
            "std::istream::sentry::operator bool() const",
            "std::istream::sentry::operator bool()",
        ),
        ("Foo::operator unsigned long() const", "Foo::operator unsigned long()"),
        // An operator inside template arguments does not unbalance them.
        (
            "void apply<&Foo::operator<, &Foo::operator->>(Foo&)",
            "apply<…>(…)",
        ),
    ]);
}

#[test]
fn lambdas_local_names_and_anonymous_namespaces_stay() {
    check(&[
        (
            "llvm::Error llvm::handleErrors<llvm::object::ELFObjectFile<llvm::object::ELFType<(llvm::support::endianness)0, false> >::getSectionIndex(llvm::object::DataRefImpl) const::{lambda(llvm::ErrorInfoBase const&)#1}>(llvm::Error, llvm::object::ELFObjectFile<llvm::object::ELFType<(llvm::support::endianness)0, false> >::getSectionIndex(llvm::object::DataRefImpl) const::{lambda(llvm::ErrorInfoBase const&)#1}&&)",
            "llvm::handleErrors<…>(…)",
        ),
        (
            "foo(int)::{lambda(int, char const*)#1}::operator()(int, char const*) const",
            "foo(…)::{lambda(…)#1}::operator()(…)",
        ),
        (
            "Bar::run() const::{lambda()#2}::operator()() const",
            "Bar::run()::{lambda()#2}::operator()()",
        ),
        (
            "(anonymous namespace)::Worker::step(std::vector<int, std::allocator<int> >&)",
            "(anonymous namespace)::Worker::step(…)",
        ),
        (
            "llvm::(anonymous namespace)::Pass::run()",
            "llvm::(anonymous namespace)::Pass::run()",
        ),
        ("Outer::{unnamed type#1}::get()", "Outer::{unnamed type#1}::get()"),
        (
            "non-virtual thunk to llvm::orc::SimpleRemoteEPC::handleMessage(llvm::orc::SimpleRemoteEPCOpcode, unsigned long, llvm::orc::ExecutorAddr, llvm::SmallVector<char, 128u>)",
            "non-virtual thunk to llvm::orc::SimpleRemoteEPC::handleMessage(…)",
        ),
        ("foo(int) [clone .cold]", "foo(…) [clone .cold]"),
        ("foo(int) [clone .isra.0] [clone .cold]", "foo(…) [clone .isra.0] [clone .cold]"),
        (
            "llvm::iterator_range<llvm::filter_iterator_impl<decltype (std::begin((std::declval<llvm::iterator_range<llvm::MachineOperand const*>&>)())), std::function<bool (llvm::MachineOperand const&)>, llvm::detail::fwd_or_bidi_tag<decltype (std::begin((std::declval<llvm::iterator_range<llvm::MachineOperand const*>&>)()))>::type> > llvm::make_filter_range<llvm::iterator_range<llvm::MachineOperand const*>, std::function<bool (llvm::MachineOperand const&)> >(llvm::iterator_range<llvm::MachineOperand const*>&&, std::function<bool (llvm::MachineOperand const&)>)",
            "llvm::make_filter_range<…>(…)",
        ),
        // Template arguments with `>` in an expression are parenthesized.
        (
            "std::enable_if<((sizeof (int))>(4)), void>::type f<int>(int)",
            "f<…>(…)",
        ),
        ("Foo<>::bar()", "Foo<>::bar()"),
    ]);
}

/// PyTorch's dispatcher frames, as they reach 1,189-character report lines.
#[test]
fn pytorch_dispatcher_frames_fit() {
    let call = "c10::impl::wrap_kernel_functor_unboxed_<c10::impl::detail::WrapFunctionIntoFunctor_<c10::CompileTimeFunctionPointer<at::Tensor (c10::DispatchKeySet, at::Tensor const&, c10::ArrayRef<long>, c10::optional<c10::ScalarType>, c10::optional<c10::Layout>, c10::optional<c10::Device>, c10::optional<bool>), &torch::autograd::VariableType::(anonymous namespace)::empty_strided>, at::Tensor, c10::guts::typelist::typelist<c10::DispatchKeySet, at::Tensor const&, c10::ArrayRef<long>, c10::optional<c10::ScalarType>, c10::optional<c10::Layout>, c10::optional<c10::Device>, c10::optional<bool> > >, at::Tensor (c10::DispatchKeySet, at::Tensor const&, c10::ArrayRef<long>, c10::optional<c10::ScalarType>, c10::optional<c10::Layout>, c10::optional<c10::Device>, c10::optional<bool>)>::call(c10::OperatorKernel*, c10::DispatchKeySet, at::Tensor const&, c10::ArrayRef<long>, c10::optional<c10::ScalarType>, c10::optional<c10::Layout>, c10::optional<c10::Device>, c10::optional<bool>)";
    assert_eq!(
        shorten(call),
        "c10::impl::wrap_kernel_functor_unboxed_<…>::call(…)"
    );
    assert_eq!(
        fit_checked(call, 48),
        "…::wrap_kernel_functor_unboxed_<…>::call(…)"
    );
    check(&[
        (
            "at::Tensor c10::Dispatcher::redispatch<at::Tensor, c10::ArrayRef<long>, c10::ArrayRef<long>, c10::optional<c10::ScalarType>, c10::optional<c10::Layout>, c10::optional<c10::Device>, c10::optional<bool> >(c10::TypedOperatorHandle<at::Tensor (c10::ArrayRef<long>, c10::ArrayRef<long>, c10::optional<c10::ScalarType>, c10::optional<c10::Layout>, c10::optional<c10::Device>, c10::optional<bool>)> const&, c10::DispatchKeySet, c10::ArrayRef<long>, c10::ArrayRef<long>, c10::optional<c10::ScalarType>, c10::optional<c10::Layout>, c10::optional<c10::Device>, c10::optional<bool>) const",
            "c10::Dispatcher::redispatch<…>(…)",
        ),
        (
            "at::native::(anonymous namespace)::structured_add_out_functional::set_output_raw_strided(long, c10::ArrayRef<long>, c10::ArrayRef<long>, c10::TensorOptions, c10::ArrayRef<at::Dimname>)",
            "at::native::(anonymous namespace)::structured_add_out_functional::set_output_raw_strided(…)",
        ),
        (
            "c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>::make<c10::Storage, c10::DispatchKeySet&, caffe2::TypeMeta&>(c10::Storage&&, c10::DispatchKeySet&, caffe2::TypeMeta&)",
            "c10::intrusive_ptr<…>::make<…>(…)",
        ),
        (
            "torch::autograd::VariableType::(anonymous namespace)::mm(c10::DispatchKeySet, at::Tensor const&, at::Tensor const&)::{lambda()#1}::operator()() const",
            "torch::autograd::VariableType::(anonymous namespace)::mm(…)::{lambda()#1}::operator()()",
        ),
        (
            "c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc(int, unsigned long, CUstream_st*)",
            "c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc(…)",
        ),
    ]);
}

/// `short` with its width checked.
fn fit_checked(name: &str, width: usize) -> String {
    let cut = short(name, width);
    assert!(cut.chars().count() <= width, "{cut} over {width}");
    cut
}

#[test]
fn front_namespaces_are_cut_to_the_width() {
    let name = "c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc(int, unsigned long, CUstream_st*)";
    assert_eq!(
        fit_checked(name, 200),
        "c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc(…)"
    );
    assert_eq!(
        fit_checked(name, 60),
        "…::Native::DeviceCachingAllocator::malloc(…)"
    );
    assert_eq!(
        fit_checked(name, 40),
        "…::DeviceCachingAllocator::malloc(…)"
    );
    assert_eq!(fit_checked(name, 16), "…::malloc(…)");
    // The last name alone is too wide: its front goes.
    assert_eq!(fit_checked(name, 8), "…lloc(…)");
    assert_eq!(fit_checked(name, 1), "…");
    assert_eq!(fit_checked(name, 0), "");
    // A thunk's words go with the front.
    let thunk = "virtual thunk to a::b::c::d()";
    assert_eq!(fit_checked(thunk, 100), thunk);
    assert_eq!(fit_checked(thunk, 12), "…::b::c::d()");
    // Whole parts would leave most of a narrow width empty: characters go.
    assert_eq!(
        fit_checked("aaaa::bbbbbbbbbbbbbbbbbbbb::c()", 12),
        "…bbbbbb::c()"
    );
    // The PyTorch frame at 40 columns: `…::call(…)` would waste most of it.
    let call = "c10::impl::wrap_kernel_functor_unboxed_<c10::impl::detail::WrapFunctionIntoFunctor_<int> >::call(c10::OperatorKernel*, c10::DispatchKeySet)";
    assert_eq!(
        fit_checked(call, 40),
        "…rap_kernel_functor_unboxed_<…>::call(…)"
    );
}

#[test]
fn rust_symbols_read_as_rust() {
    check(&[
        (
            "<alloc::vec::Vec<u8> as core::clone::Clone>::clone::h0123456789abcdef",
            "<Vec<…> as Clone>::clone",
        ),
        (
            "<&mut W as core::fmt::Write>::write_str",
            "<&mut W as Write>::write_str",
        ),
        (
            "<std::io::error::Error as core::fmt::Debug>::fmt",
            "<Error as Debug>::fmt",
        ),
        ("<alloc::vec::Vec<u8>>::push", "<Vec<…>>::push"),
        ("<[u8] as core::fmt::Debug>::fmt", "<[u8] as Debug>::fmt"),
        (
            "core::ptr::drop_in_place<alloc::vec::Vec<alloc::string::String>>",
            "core::ptr::drop_in_place<Vec<…>>",
        ),
        (
            "core::ptr::drop_in_place::<alloc::vec::Vec<u8>>",
            "core::ptr::drop_in_place::<Vec<…>>",
        ),
        (
            "alloc::raw_vec::RawVec<T,A>::grow_one::h5b1d1f3c8d2e0a71",
            "alloc::raw_vec::RawVec<…>::grow_one",
        ),
        (
            "std::rt::lang_start::{{closure}}::h2b5a3c1d9e8f7a6b",
            "std::rt::lang_start::{{closure}}",
        ),
        (
            "std::rt::lang_start::<()>::{closure#0}",
            "std::rt::lang_start::<…>::{closure#0}",
        ),
        (
            "memtrace::trace::run::{{closure}}",
            "memtrace::trace::run::{{closure}}",
        ),
        (
            "core::ptr::drop_in_place<[core::option::Option<plotters::drawing::area::DrawingArea<plotters_svg::svg::SVGBackend,plotters::coord::Shift>>]>",
            "core::ptr::drop_in_place<[Option<…>]>",
        ),
        (
            "core::array::iter::<impl core::iter::traits::collect::IntoIterator for [T; N]>::into_iter",
            "core::array::iter::<impl IntoIterator for [T; N]>::into_iter",
        ),
        (
            "alloc::vec::partial_eq::<impl core::cmp::PartialEq<alloc::vec::Vec<U,A2>> for alloc::vec::Vec<T,A1>>::eq",
            "alloc::vec::partial_eq::<impl PartialEq<…> for Vec<…>>::eq",
        ),
        (
            "<T as alloc::string::SpecToString>::spec_to_string",
            "<T as SpecToString>::spec_to_string",
        ),
        // A closure keeps the name it is in.
        (
            "core::ptr::drop_in_place<alloc::vec::Vec<f64>::extend_trusted<core::iter::adapters::map::Map<I,F>>::{{closure}}>",
            "core::ptr::drop_in_place<extend_trusted<…>::{{closure}}>",
        ),
        (
            "<core::ops::control_flow::ControlFlow<B,C> as core::ops::try_trait::FromResidual<core::ops::control_flow::ControlFlow<B,core::convert::Infallible>>>::from_residual",
            "<ControlFlow<…> as FromResidual<…>>::from_residual",
        ),
        // Not a hash: too short, or not hex.
        ("foo::h0123", "foo::h0123"),
        ("foo::hxyz456789abcdef0", "foo::hxyz456789abcdef0"),
    ]);
}

#[test]
fn names_left_mangled_keep_their_front() {
    // Seen from blazesym on g++ 12's `std::make_shared<std::vector<float>>`.
    let mangled = "_ZSt11make_sharedISt6vectorIfSaIfEEJmEESt10shared_ptrINSt9enable_ifIXntsrSt8is_arrayIT_E5valueES6_E4typeEEDpOT0_";
    assert_eq!(fit_checked(mangled, 24), "_ZSt11make_sharedISt6ve…");
    assert_eq!(fit_checked(mangled, 200), mangled);
    assert_eq!(fit_checked("_ZN3foo3barEv.cold", 10), "_ZN3foo3b…");
    assert_eq!(fit_checked("_RNvCs1234_7mycrate3foo", 8), "_RNvCs1…");
    // `_Z` words that are names: not mangled, cut as names.
    assert_eq!(fit_checked("_Zfoo::bar::baz()", 12), "…::baz()");
}

#[test]
fn python_names_are_only_cut() {
    assert_eq!(fit_plain("Handler.handle", 40), "Handler.handle");
    assert_eq!(fit_plain("pkg.module.Handler.handle", 12), "…dler.handle");
    assert_eq!(fit_plain("<module>", 3), "…e>");
    assert_eq!(fit_plain("ünïcödé", 4), "…ödé");
    assert_eq!(fit_plain("abc", 0), "");
}

#[test]
fn malformed_names_come_back_whole_and_never_panic() {
    check(&[
        ("", ""),
        ("foo<int", "foo<int"),
        ("foo(int", "foo(int"),
        ("foo[abi", "foo[abi"),
        ("foo>bar", "foo>bar"),
        ("foo)bar", "foo)bar"),
        ("{lambda(", "{lambda("),
        ("}}}::a", "}}}::a"),
        ("operator", "operator"),
        ("a::operator", "a::operator"),
        ("::", "::"),
        ("::a::", "::a::"),
        ("<", "<"),
        (">", ">"),
        ("ünï::cödé<x>(y)", "ünï::cödé<…>(…)"),
    ]);
    // Anything at all: no panic, no loop, within the width, and the
    // shortening is stable.
    let alphabet: Vec<char> = "<>()[]{}: ,&*-#abcoperatnsl\"~ü".chars().collect();
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    for _ in 0..4000 {
        let len = (seed % 48) as usize;
        let text: String = (0..len)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                alphabet[(seed % alphabet.len() as u64) as usize]
            })
            .collect();
        let once = shorten(&text);
        assert!(once.len() <= text.len() + 8, "{text:?} grew to {once:?}");
        for width in [0, 1, 5, 20] {
            assert!(short(&text, width).chars().count() <= width, "{text:?}");
        }
    }
    // Deep nesting and long runs stay fast.
    let deep = format!("{}x{}", "<".repeat(20_000), ">".repeat(20_000));
    assert_eq!(shorten(&deep), "<<<<<…>>>>>");
    let open = "a<(".repeat(20_000);
    assert_eq!(shorten(&open), open);
    let nested = "<a as <b as <c as <d as <e as <f as g>>>>>>::h";
    assert!(shorten(nested).ends_with("::h"), "{}", shorten(nested));
}
